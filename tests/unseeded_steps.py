"""Training steps that draw from the global random stream as it stands (tests of the
checkpoint's RNG state).

bert-train and bert-finetune re-seed the global generator before every micro-batch
(dropout_seed), so a resume reproduces the masks whether or not it restores the saved RNG
state, and a resume test alone cannot tell whether the restore works. With the re-seed switched
off, each step continues the stream of the step before it, as any draw not re-seeded per step
would: a resumed run then matches an uninterrupted one only if the checkpoint saved the state at
the step boundary and the resume restored it after all of its set-up's draws."""

import torch


def without_reseed(monkeypatch, cls) -> None:
    """Make `cls.train_step` (Trainer or FineTune) skip its torch.manual_seed calls; set-up,
    which seeds the model's initialisation, still seeds."""
    train_step = cls.train_step

    def unseeded(self):
        with monkeypatch.context() as m:
            m.setattr(torch, "manual_seed", lambda seed: None)
            return train_step(self)

    monkeypatch.setattr(cls, "train_step", unseeded)
