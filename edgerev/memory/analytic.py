"""Analytic bytes per input pixel (placeholder; filled below)."""

def model_bytes_per_pixel(model) -> float:
    return float("nan")
