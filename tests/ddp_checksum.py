"""A callback for the DDP CLI test, loaded by class path in the ``loko`` processes (tests/ is on their PYTHONPATH)."""

import os
import signal

import lightning.pytorch as pl
import torch

from loko_lightning.learner.steps import nested_steps


class Checksum(pl.Callback):
    """At the end of training, every rank's θ̃ and LoKO's p̂ and R (float64, one vector; with the mixture, its weights,
    LDA's hits and head too), gathered and saved by rank 0, with the start's θ̃ and p̂, the last step's cond(S) and how
    many parameters' p̂ each rank held before gathering."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.start: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        opt, params = trainer.optimizers[0], pl_module.trainable_parameters
        self.start["theta"] = torch.cat([p.detach().reshape(-1) for p in params]).double().cpu()
        if all("cov" in opt.state.get(p, {}) for p in params):
            self.start["cov"] = torch.cat([opt.state[p]["cov"].reshape(-1) for p in params]).double().cpu()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        opt = trainer.optimizers[0]
        params = pl_module.trainable_parameters
        parts = [p.detach().reshape(-1) for p in params]
        held = torch.tensor([sum("cov" in opt.state.get(p, {}) for p in params)], device=parts[0].device)
        cond = float(opt.diagnostics["cond"]) if hasattr(opt, "diagnostics") else float("nan")
        if hasattr(opt, "consolidate_state_dict"):  # LoKO's filter state, every shard's p̂ gathered when sharded
            opt.consolidate_state_dict()
            state = opt.state_dict()["state"]
            parts += [state[i]["cov"].reshape(-1) for i in range(len(params))] + [state[0]["R"].reshape(-1)]
        mixture = next((s for s in nested_steps(pl_module.online_step) if hasattr(s, "log_weights")), None)
        if mixture is not None and mixture.head is not None:  # the mixture's weights, LDA's hits and head
            parts += [mixture.log_weights, mixture.hits[None], mixture.seen[None], *mixture.head.parameters()]
            parts += list(getattr(mixture, "nearest", None) or ())  # nearest class mean's head, with nearest_mean
            if getattr(mixture, "bin_gaps", None) is not None:  # the recalibration's bins, with calibration
                parts += [mixture.bin_gaps, mixture.bin_counts]
        mine = torch.cat([part.detach().reshape(-1).double() for part in parts])
        gathered = pl_module.all_gather(mine)
        held = pl_module.all_gather(held)
        if trainer.is_global_zero:
            saved = {"states": gathered.cpu(), "world_size": trainer.world_size, "held": held.reshape(-1).tolist()}
            torch.save({**saved, "start": self.start, "cond": cond, "parameters": len(params)}, self.path)


class PoisonOneRank(pl.Callback):
    """Puts a NaN into the input of one process's batch at one step (the other processes' inputs stay finite)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and batch_idx == self.step:
            batch["inputs"].view(-1)[0] = float("nan")


class LoseOneRank(pl.Callback):
    """One process dies (``SIGKILL``, as the OOM killer does) or hangs (``SIGSTOP``) before training step ``step``."""

    def __init__(self, rank: int, step: int, signal: str = "SIGKILL") -> None:
        self.rank, self.step, self.signal = rank, step, signal

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), getattr(signal, self.signal))
