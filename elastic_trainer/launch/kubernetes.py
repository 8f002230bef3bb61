"""A Kubeflow PyTorchJob for the elastic job, rendered from launch/kubernetes/pytorchjob.yaml.

Pure: builds text, runs nothing. Every value goes into the template as a JSON scalar or list (JSON is YAML),
so an image name or a training argument can never add YAML structure; names are checked as Kubernetes
checks them (DNS-1035 labels for the job, DNS-1123 subdomains for the claim) so that a bad one is refused
here in one line rather than by the API server.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path

from elastic_trainer.config import ConfigError

TEMPLATE = Path(__file__).resolve().parents[2] / "launch" / "kubernetes" / "pytorchjob.yaml"
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
# the train flags the job sets itself (every pod must agree on them)
OWNED_FLAGS = ("--checkpoint-dir", "--resume", "--layout")


@dataclass(frozen=True)
class PyTorchJobSpec:
    image: str
    min_replicas: int
    max_replicas: int
    gpus_per_replica: int
    checkpoint_claim: str
    """A ReadWriteMany PersistentVolumeClaim every pod mounts: the checkpoints outlive the pods."""
    name: str = "elastic-trainer"
    replicas: int | None = None
    """Pods at the start (default: max_replicas)."""
    mount_path: str = "/checkpoints"
    max_restarts: int = 100
    """Rendezvous rounds TorchElastic allows (each scale event and each failure uses one)."""
    rdzv_port: int = 29400
    grace_s: int = 300
    """Seconds between a pod's SIGTERM and its SIGKILL: the ranks' final save must fit in it."""
    train_args: tuple[str, ...] = field(default_factory=tuple)

    def check(self) -> None:
        if not self.image or any(c.isspace() for c in self.image):
            raise ConfigError(f"--image must be a container image reference without spaces, got {self.image!r}")
        if not _DNS1035.match(self.name):
            raise ConfigError(
                f"--name {self.name!r} is not a valid PyTorchJob name (lower-case letters, digits and "
                "'-', starting with a letter, at most 63 characters)"
            )
        if not _DNS1123_SUBDOMAIN.match(self.checkpoint_claim):
            raise ConfigError(f"--checkpoint-claim {self.checkpoint_claim!r} is not a valid claim name")
        for what, value in (
            ("--min-replicas", self.min_replicas),
            ("--max-replicas", self.max_replicas),
            ("--gpus-per-replica", self.gpus_per_replica),
            ("--grace-s", self.grace_s),
        ):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{what} must be a positive integer, got {value!r}")
        if not isinstance(self.rdzv_port, int) or not 1 <= self.rdzv_port <= 65535:
            raise ConfigError(f"--rdzv-port must be a port number, got {self.rdzv_port!r}")
        if self.min_replicas > self.max_replicas:
            raise ConfigError(f"--min-replicas {self.min_replicas} is above --max-replicas {self.max_replicas}")
        start = self.start_replicas
        if not self.min_replicas <= start <= self.max_replicas:
            raise ConfigError(f"--replicas {start} is outside {self.min_replicas}..{self.max_replicas}")
        if not self.mount_path.startswith("/"):
            raise ConfigError(f"--mount-path must be absolute, got {self.mount_path!r}")
        owned = [a for a in self.train_args if a.split("=", 1)[0] in OWNED_FLAGS]
        if owned:
            raise ConfigError(
                f"{owned[0].split('=', 1)[0]} is set by the PyTorchJob (checkpoints on the claim, "
                "resume auto, a layout planned for each size); drop it from the train arguments"
            )

    @property
    def start_replicas(self) -> int:
        return self.max_replicas if self.replicas is None else self.replicas

    @property
    def checkpoint_dir(self) -> str:
        return f"{self.mount_path.rstrip('/')}/{self.name}"

    def command(self) -> list[str]:
        """The container's command: our torchrun (its settings from the operator's PET_* variables) and train."""
        return [
            "python",
            "-m",
            "elastic_trainer.cli",
            "torchrun",
            "train",
            "--checkpoint-dir",
            self.checkpoint_dir,
            "--resume",
            "auto",
            *self.train_args,
        ]


def render(spec: PyTorchJobSpec, template: Path = TEMPLATE) -> str:
    """The manifest as YAML text (ConfigError on a bad setting)."""
    spec.check()
    values = {
        "NAME": spec.name,
        "MIN_REPLICAS": spec.min_replicas,
        "MAX_REPLICAS": spec.max_replicas,
        "MAX_RESTARTS": spec.max_restarts,
        "RDZV_PORT": spec.rdzv_port,
        "NPROC_PER_NODE": str(spec.gpus_per_replica),
        "GPUS_PER_REPLICA": spec.gpus_per_replica,
        "REPLICAS": spec.start_replicas,
        "GRACE_S": spec.grace_s,
        "IMAGE": spec.image,
        "COMMAND": spec.command(),
        "MOUNT_PATH": spec.mount_path,
        "CHECKPOINT_CLAIM": spec.checkpoint_claim,
    }
    text = template.read_text()
    try:
        return string.Template(text).substitute({k: json.dumps(v) for k, v in values.items()})
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{template}: a placeholder the renderer does not know ({e})") from None
