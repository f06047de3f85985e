"""ONNX export, inference and head fine-tuning figures, written as JSON.

* every registry model at its default width, 10 classes, 32x32: export seconds, verification seconds,
  file size, opset, and the largest difference of logits between ONNX Runtime and PyTorch;
* ``Predictor`` latency per image at batch 1 (RevNeXt, stem width 32, 32x32): end to end (decode a PNG,
  resize, normalize, run, softmax) and the ONNX Runtime call alone, median over repeats;
* head fine-tuning with each backend installed (numpy; ONNX Runtime training) on the generated data
  set (10 classes): accuracy on a held-out range before and after, and the time it took (backbone
  features included). The backbone has random weights: the figure shows the mechanism, not a trained model's accuracy;
* with ``--run DIR``, a model directory trained on the generated data set (``configs/cpu-demo.yaml``):
  its export's accuracy against PyTorch's on the held-out range the recipe validates on, then the
  same model with its head re-initialized, fine-tuned by each backend on 1000 training images.

    edgerev train --config configs/cpu-demo.yaml --out runs/cpu-demo
    python benchmarks/export.py --run runs/cpu-demo --out results/export.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime
import torch
from _common import write_json

from edgerev.engine import plain
from edgerev.export.finetune import finetune_head
from edgerev.export.images import normalize
from edgerev.export.onnx import export_onnx
from edgerev.export.predict import Predictor
from edgerev.models import create_model, list_models
from edgerev.models.directory import ModelInfo, load_model, save_model
from edgerev.models.directory import normalize as torch_normalize
from edgerev.train.data import SyntheticImages

CLASSES = tuple(f"class{i}" for i in range(10))


def export_all(folder: Path, size: int) -> list[dict]:
    rows = []
    for arch in list_models():
        torch.manual_seed(0)
        info = ModelInfo(arch=arch, classes=CLASSES, input_size=size)
        save_model(folder / arch, create_model(arch, num_classes=len(CLASSES)), info)
        r = export_onnx(folder / arch, folder / f"{arch}.onnx", batch=8)
        rows.append({k: v for k, v in r.to_json().items() if k not in ("path", "weights_sha256")})
        print(f"exported {arch}: {r.seconds:.1f} s, max abs diff {r.max_abs_diff:.2e}", flush=True)
    return rows


def images(n: int, size: int, start: int = 0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    ds = SyntheticImages(start + n, num_classes=len(CLASSES), size=size, seed=seed)
    items = [ds[i] for i in range(start, start + n)]
    return np.stack([x.numpy() for x, _ in items]), np.array([y for _, y in items], dtype=np.int64)


def predict_latency(path: Path, folder: Path, size: int, repeats: int) -> dict:
    from PIL import Image

    pixels, _ = images(repeats, size)
    files = []
    for i, img in enumerate(pixels):
        files.append(folder / f"img{i}.png")
        Image.fromarray(img.transpose(1, 2, 0)).save(files[-1])
    predictor = Predictor(path)
    for f in files[:5]:  # warm-up
        predictor.predict([f])
    end_to_end, session_only = [], []
    for f, img in zip(files, pixels):
        t0 = time.perf_counter()
        predictor.predict([f])
        end_to_end.append(time.perf_counter() - t0)
        x = normalize(img[None], predictor.meta.mean, predictor.meta.std)
        t0 = time.perf_counter()
        predictor.session.run(None, {predictor.input_name: x})
        session_only.append(time.perf_counter() - t0)
    return {"batch": 1, "repeats": repeats, "end_to_end_ms": 1e3 * statistics.median(end_to_end),
            "session_run_ms": 1e3 * statistics.median(session_only)}


def backends() -> list[str]:
    """The head-training backends installed here: numpy always, ONNX Runtime training where present."""
    return ["numpy", "onnxruntime"] if (Path(onnxruntime.__file__).parent / "training" / "api").is_dir() else ["numpy"]


def finetune(path: Path, folder: Path, size: int, n_train: int, n_val: int, epochs: int) -> dict:
    train, val = images(n_train, size), images(n_val, size, start=n_train)
    keep = ("samples", "val_samples", "epochs", "lr", "optimizer", "train_accuracy_before", "train_accuracy_after",
            "val_accuracy_before", "val_accuracy_after", "max_abs_diff", "seconds", "backend")
    out = {}
    for backend in backends():
        r = finetune_head(path, train, folder / "tuned.onnx", val=val, epochs=epochs, backend=backend)
        out[backend] = {**{k: v for k, v in r.to_json().items() if k in keep}, "first_loss": r.losses[0],
                        "last_loss": r.losses[-1]}
    return out


def trained_run(run: Path, folder: Path, n_train: int, epochs: int, val_start: int = 1_000_000) -> dict:
    """A trained model: ONNX against PyTorch accuracy, then head fine-tuning of a re-initialized head, per backend."""
    model, info, _ = load_model(run)
    model.eval()
    r = export_onnx(run, folder / "run.onnx", batch=8)
    val = images(1000, info.input_size, start=val_start)
    onnx_pred = np.concatenate([Predictor(r.path).logits(val[0][i:i + 100]).argmax(1) for i in range(0, 1000, 100)])
    with plain(model), torch.no_grad():
        torch_pred = model(torch_normalize(torch.from_numpy(val[0]), info)).argmax(1).numpy()
    torch.manual_seed(1)
    model.head.reset_parameters()
    save_model(folder / "reinit", model, info)
    export_onnx(folder / "reinit", folder / "reinit.onnx")
    reinit = {}
    for backend in backends():
        tuned = finetune_head(folder / "reinit.onnx", images(n_train, info.input_size), folder / "tuned.onnx",
                              val=val, epochs=epochs, backend=backend)
        reinit[backend] = {"samples": tuned.samples, "epochs": tuned.epochs,
                           "val_accuracy_before": tuned.val_accuracy_before,
                           "val_accuracy_after": tuned.val_accuracy_after, "seconds": tuned.seconds}
    return {"run": str(run), "export_seconds": r.seconds, "max_abs_diff": r.max_abs_diff,
            "onnx_val_accuracy": float(np.mean(onnx_pred == val[1])),
            "torch_val_accuracy": float(np.mean(torch_pred == val[1])),
            "onnx_torch_agreement": float(np.mean(onnx_pred == torch_pred)),
            "reinit_head_finetune": reinit}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=100, help="images timed for the predict latency")
    p.add_argument("--train", type=int, default=1000, help="fine-tuning images")
    p.add_argument("--val", type=int, default=500, help="held-out images")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--run", type=Path, help="a model directory trained by configs/cpu-demo.yaml")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        exports = export_all(folder, a.size)
        latency = predict_latency(folder / "revnext.onnx", folder, a.size, a.repeats)
        tuned = finetune(folder / "revnext.onnx", folder, a.size, a.train, a.val, a.epochs)
        run = trained_run(a.run, folder, a.train, a.epochs) if a.run else None
    result = {
        "torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "cpu": platform.processor() or "cpu",
        "threads": torch.get_num_threads(), "size": a.size, "exports": exports,
        "predict_revnext": latency, "finetune_head_revnext": tuned,
    }
    if run is not None:
        result["trained_run"] = run
    write_json(result, a.out)


if __name__ == "__main__":
    main()
