"""What the benchmark scripts share."""


def write_json(result: dict, out) -> None:
    """Print ``result`` as JSON and write it to ``out`` (a path) when given."""
    import json

    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
