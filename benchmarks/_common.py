"""What the benchmark scripts share."""

import contextlib
import io
import logging
import warnings


def write_json(result: dict, out) -> None:
    """Print ``result`` as JSON and write it to ``out`` (a path) when given."""
    import json

    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


@contextlib.contextmanager
def quiet():
    """Hide the exporters' and compilers' chatter (progress lines on stdout, warnings, log records)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        level = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(level)
