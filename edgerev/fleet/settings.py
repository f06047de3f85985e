"""The settings of a fleet run, read once from Flower's run config (flat keys, scalar values).

Flower carries a run's settings as ``context.run_config`` (``[tool.flwr.app.config]`` in the app's
``pyproject.toml``, or ``flwr run --run-config``); the simulation builds the same mapping from its YAML.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from edgerev.config import ConfigError, check

SHARING = ("head", "head+last", "all")


@dataclass(frozen=True)
class FleetSettings:
    """``sharing``: what travels (``head``, ``head+last``: and the last stage with weights, ``all``: every
    trainable tensor); batch-norm statistics stay on the devices (FedBN) unless ``share_bn_stats``: then the
    fleet's statistics, which every device trains at with its batch norms frozen (from the second round on;
    the first trains as a device alone does) and measures anew over its own samples after each round job,
    layer after layer (:mod:`edgerev.train.norms`); the fleet averages them as moments
    (:mod:`edgerev.fleet.aggregate`).
    ``local_epochs``: epochs of each device's round job; ``lr``: its peak learning rate (0: the device's
    ``training.optim.lr``). ``adopt_epochs`` > 0: before its gate judges the fleet model, a device fine-tunes
    it on its own samples for that many epochs, distilling from it with weight ``adopt_distill`` (so it keeps
    the classes it does not have) at peak learning rate ``adopt_lr`` (0: ``lr``), and the gate judges that.
    ``judge_from``: the first round whose fleet model goes to the devices' gates (a fleet that does not know
    the classes yet gains nothing from a gate's time, nor from a fine-tuning that distills from it).
    ``dp_clipping_norm`` > 0 turns on central DP with
    client-side fixed clipping (Flower's ``fixedclipping_mod`` and its strategy wrapper) with Gaussian noise
    of ``dp_noise_multiplier`` x the norm / the devices sampled (the Gaussian mechanism's scale for a uniform
    average; the fleet's average weights devices by their sample counts and head rows by per-class counts,
    so no (epsilon, delta) is claimed: Flower 1.41's accountant accepts only uniform FedAvg).
    ``secagg``: secure aggregation (SecAgg+, :mod:`edgerev.fleet.secagg`): the server learns only the sum of
    the devices' updates; ``secagg_shares``: each device's neighbourhood (odd, >= 3; 0: every device of the
    round), ``secagg_threshold``: the fraction of it whose shares rebuild a secret, ``secagg_range``: the
    largest update a device may send (each weighted term is quantized over +- this; beyond it the device is
    left out of the round, with the reason). ``min_devices``: devices a round waits for;
    ``timeout``: seconds a round waits for their replies (a device that has not answered by then is left out).
    ``arch``: the fleet's model, any model source (a registry name with ``model_args``, a model directory, an
    ONNX file, a factory ``package.module:callable``: :mod:`edgerev.models.resolve`); ``weights``: a
    safetensors or ``state_dict`` file for a registry name or a factory ("": none). A source that brings
    weights is the fleet's *base*: the server's first parameters and every device's first round start from
    it, its classifier sized to the fleet's classes; the file must be at that path on the server and on
    every device."""

    rounds: int = 3
    sharing: str = "all"
    share_bn_stats: bool = False
    local_epochs: int = 1
    lr: float = 0.0
    adopt_epochs: int = 0
    adopt_distill: float = 1.0
    adopt_lr: float = 0.0
    judge_from: int = 1
    seed: int = 0
    arch: str = "revnext"
    model_args: dict = field(default_factory=dict)
    weights: str = ""
    image_size: int = 32
    min_devices: int = 2
    timeout: float = 3600.0
    dp_clipping_norm: float = 0.0
    dp_noise_multiplier: float = 0.0
    secagg: bool = False
    secagg_shares: int = 0
    secagg_threshold: float = 2 / 3
    secagg_range: float = 8.0

    def __post_init__(self) -> None:
        from edgerev.errors import UnknownModelError
        from edgerev.models.names import SourceKind, source_kind  # no torch: the settings stay light

        try:
            kind = source_kind(self.arch)
        except UnknownModelError as e:
            check(False, "arch", str(e))
        if kind in (SourceKind.DIRECTORY, SourceKind.ONNX):
            check(not self.model_args, "model_args", f"{self.arch} carries its own architecture; leave it out")
            check(not self.weights, "weights", f"{self.arch} carries its own weights; leave weights out")
        check(self.rounds >= 1, "rounds", f"must be at least 1, got {self.rounds}")
        check(self.sharing in SHARING, "sharing", f"must be one of {', '.join(SHARING)}, got {self.sharing!r}")
        check(self.local_epochs >= 1, "local_epochs", f"must be at least 1, got {self.local_epochs}")
        check(self.lr >= 0, "lr", f"must be >= 0 (0: the device's training.optim.lr), got {self.lr}")
        check(self.adopt_epochs >= 0, "adopt_epochs", f"must be >= 0 (0: the gate judges the fleet model as is), "
                                                      f"got {self.adopt_epochs}")
        check(self.adopt_distill >= 0, "adopt_distill", f"must be >= 0, got {self.adopt_distill}")
        check(self.judge_from >= 1, "judge_from", f"must be at least 1, got {self.judge_from}")
        check(self.adopt_lr >= 0, "adopt_lr", f"must be >= 0 (0: lr), got {self.adopt_lr}")
        check(self.min_devices >= 1, "min_devices", f"must be at least 1, got {self.min_devices}")
        check(self.timeout > 0, "timeout", f"must be positive, got {self.timeout}")
        check(self.dp_clipping_norm >= 0, "dp_clipping_norm", f"must be >= 0, got {self.dp_clipping_norm}")
        check(self.dp_noise_multiplier >= 0, "dp_noise_multiplier", f"must be >= 0, got {self.dp_noise_multiplier}")
        check(not (self.dp_noise_multiplier > 0 and self.dp_clipping_norm == 0), "dp_noise_multiplier",
              "needs dp_clipping_norm > 0 (noise is calibrated to the clipping norm)")
        check(self.secagg_shares == 0 or (self.secagg_shares >= 3 and self.secagg_shares % 2 == 1),
              "secagg_shares", f"must be 0 (every device) or odd and at least 3, got {self.secagg_shares}")
        check(0 < self.secagg_threshold <= 1, "secagg_threshold", f"must be in (0, 1], got {self.secagg_threshold}")
        check(self.secagg_range > 0, "secagg_range", f"must be positive, got {self.secagg_range}")
        check(not self.secagg or self.min_devices >= 2, "min_devices",
              f"must be at least 2 with secagg (a sum of one update is that update), got {self.min_devices}")

    @property
    def dp(self) -> bool:
        return self.dp_clipping_norm > 0

    def to_run_config(self) -> dict[str, bool | int | float | str]:
        """Flower's run config: kebab-case keys, scalars only (the model's arguments as JSON text)."""
        out: dict[str, bool | int | float | str] = {}
        for k, v in asdict(self).items():
            out[k.replace("_", "-")] = json.dumps(v, sort_keys=True) if isinstance(v, dict) else v
        return out

    @staticmethod
    def from_run_config(run_config: dict) -> FleetSettings:
        """Read the settings back (unknown keys are Flower's or the app's own and are left alone).

        Raises:
            ConfigError: a value of the wrong type or out of range (the key is named).
        """
        kwargs: dict = {}
        for name, f in FleetSettings.__dataclass_fields__.items():
            key = name.replace("_", "-")
            if key not in run_config:
                continue
            value = run_config[key]
            if name == "model_args":
                try:
                    value = json.loads(value) if isinstance(value, str) else value
                except ValueError as e:
                    raise ConfigError(f"{key}: not JSON: {e}") from None
                check(isinstance(value, dict), key, f"expected a JSON object, got {value!r}")
            elif f.type == "float" and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            want = {"int": int, "float": float, "bool": bool, "str": str}.get(str(f.type))
            if want is not None and (not isinstance(value, want) or (want is int and isinstance(value, bool))):
                raise ConfigError(f"{key}: expected {want.__name__}, got {type(value).__name__} {value!r}")
            kwargs[name] = value
        try:
            return FleetSettings(**kwargs)
        except ConfigError as e:
            raise ConfigError(str(e).replace("_", "-", 1) if str(e).split(":")[0] in kwargs else str(e)) from None
