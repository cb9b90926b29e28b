"""Everything a process derives from the job spec, computed once the same way by every role.

Servers, workers, the launcher and tests all build a `JobContext` from the same `Job`, so the model shape,
row placement, dense chunking and optimizer settings can never disagree between processes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from ecrec import auth
from ecrec.core.optim import RowOptimizer, make_optimizer
from ecrec.core.placement import Placement, chunk_bounds, dense_replicas
from ecrec.model import ModelConfig
from ecrec.spec import Job, JobSpec, job_from_spec


@dataclass(frozen=True)
class JobContext:
    job: Job
    # The job token (ecrec.auth): what this process sends with its calls and, as a server, demands.
    token: str | None = field(default_factory=auth.from_env, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.job.name

    @property
    def spec(self) -> JobSpec:
        return self.job.spec

    @cached_property
    def model(self) -> ModelConfig:
        return self.spec.model_config_resolved()

    @property
    def num_servers(self) -> int:
        return self.spec.servers.replicas

    @property
    def ecrec(self) -> bool:
        return self.spec.fault_tolerance.strategy == "ecrec"

    @property
    def checkpointing(self) -> bool:
        """A checkpoint strategy (checkpoint, checknrun, cpr): servers restore from stable storage."""
        return self.spec.fault_tolerance.strategy in ("checkpoint", "checknrun", "cpr")

    @cached_property
    def placement(self) -> Placement:
        if self.ecrec:
            ec = self.spec.fault_tolerance.ecrec
            return Placement(num_servers=self.num_servers, k=ec.k, r=ec.r, num_rows=self.model.num_rows)
        # No parity: only the data-shard half of the placement is used.
        return Placement(num_servers=self.num_servers, k=1, r=0, num_rows=self.model.num_rows)

    @cached_property
    def optimizer(self) -> RowOptimizer:
        t = self.spec.training
        return make_optimizer(
            t.optimizer,
            t.learning_rate,
            momentum=t.momentum,
            beta1=t.beta1,
            beta2=t.beta2,
            eps=t.eps,
            weight_decay=t.weight_decay,
        )

    @property
    def dim(self) -> int:
        return self.model.dim

    @property
    def record_width(self) -> int:
        return self.optimizer.record_width(self.model.dim)

    @property
    def dense_record_width(self) -> int:
        return self.optimizer.record_width(1)

    @cached_property
    def dense_numel(self) -> int:
        return self.model.dense_numel

    @cached_property
    def dense_bounds(self) -> list[tuple[int, int]]:
        return chunk_bounds(self.dense_numel, self.num_servers)

    def dense_holders(self, chunk: int) -> tuple[int, ...]:
        return self._dense_holders[chunk]

    @cached_property
    def _dense_holders(self) -> tuple[tuple[int, ...], ...]:
        # asked for every chunk of every pull and update: the spec's property chain once, not each time
        ec = self.spec.fault_tolerance.ecrec
        copies = ec.r + 1 if self.ecrec and ec.replicate_dense else 1
        return tuple(dense_replicas(c, self.num_servers, copies) for c in range(self.num_servers))

    def dense_chunks_of(self, shard: int) -> list[int]:
        return [c for c in range(self.num_servers) if shard in self.dense_holders(c)]

    @cached_property
    def table_offsets(self) -> torch.Tensor:
        return self.model.table_offsets

    # -- serialization for child processes -------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({"name": self.job.name, "spec": self.spec.to_dict()})

    @classmethod
    def from_json(cls, text: str) -> JobContext:
        doc = json.loads(text)
        return cls(job_from_spec(doc["name"], doc["spec"]))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> JobContext:
        return cls.from_json(Path(path).read_text())

    @classmethod
    def load(cls, ref: str) -> JobContext:
        """From a `--job` argument: a JSON file ({name, spec}), or `env:VAR` for the JSON in an environment
        variable (pods get the job that way: no volume to mount)."""
        if ref.startswith("env:"):
            var = ref[4:]
            if var not in os.environ:
                raise SystemExit(f"--job {ref}: environment variable {var} is not set")
            return cls.from_json(os.environ[var])
        return cls.from_file(ref)
