"""Model variants under 2 processes launched the way users launch them (accelerate, gloo on
CPU): relative position embeddings, pre-LN, and speed switches.  DDP needs every parameter to
take part in the forward pass (an unused one stops the second step with "Expected to have
finished reduction in the prior iteration"), and the 2-process run must equal 1 process with 2
accumulation steps."""
from __future__ import annotations

import re

import pytest

from test_distributed import (assert_same_trajectory, train_1proc, train_accelerate,
                              train_records, write_prepared)

pytestmark = pytest.mark.slow      # two launches per variant: ~30 s each on a shared CPU


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    return write_prepared(str(tmp_path_factory.mktemp("prepared") / "data"), num_train=40)


@pytest.mark.parametrize("variant", [
    ["model.position_embedding_type=relative_key"],
    ["model.pre_layer_norm=true"],
    # speed switches under DDP and accumulation (docs/model.md's switch matrix): nested
    # tensors recomputed by gradient checkpointing, with the fused projection
    ["impl.varlen_attention=nested", "impl.gradient_checkpointing=true", "impl.fused_qkv=true"],
    # each process's batches read ahead by its own worker process, with dynamic masks on a
    # schedule (tests/test_prefetch.py: the same batches as without it in one process)
    ["trainer.prefetch=true", "data.masking=dynamic", "data.masked_lm_prob_start=0.4"],
], ids=["relative_key", "pre_ln", "nested_checkpointing", "prefetch"])
def test_two_processes_equal_one_process_with_accumulation(prepared, tmp_path, variant):
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    train_1proc(f"data.dir={prepared}", f"run_dir={one_dir}", "trainer.micro_batch_size=4",
                *variant)
    r = train_accelerate(2, f"data.dir={prepared}", f"run_dir={two_dir}", *variant)
    assert "2 process(es), global batch 8 = 2 x 4 x 1 accumulation" in r.stdout, r.stdout
    assert r.stdout.count("bert-train: finished at step 6") == 1
    if "trainer.prefetch=true" in variant:
        assert "batches read ahead by a worker process (trainer.prefetch=true)" in r.stdout
    one, two = train_records(one_dir), train_records(two_dir)
    assert sorted(two) == list(range(1, 7))
    assert_same_trajectory(one, two, range(1, 7))
    assert [two[s]["tokens_seen"] for s in range(1, 7)] == [one[s]["tokens_seen"]
                                                             for s in range(1, 7)]


def compiled_by(stderr: str) -> set[str]:
    """The process ids whose inductor wrote kernels (TORCH_LOGS=output_code): proof that
    impl.compile compiled in that process rather than running eager."""
    return set(re.findall(r"^\S+ \S+ (\d+) .*\[__output_code\] Output code:", stderr, re.M))


def test_compiled_layers_under_two_processes_equal_one_process(prepared, tmp_path,
                                                               monkeypatch):
    """impl.compile (inductor, each layer's dense blocks) under DDP: both processes compile,
    and train the losses of one process with 2 accumulation steps (the same micro-batch shapes,
    so the same kernels)."""
    monkeypatch.setenv("TORCH_LOGS", "output_code")
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    r1 = train_1proc(f"data.dir={prepared}", f"run_dir={one_dir}", "trainer.micro_batch_size=4",
                     "impl.compile=true")
    r2 = train_accelerate(2, f"data.dir={prepared}", f"run_dir={two_dir}", "impl.compile=true")
    assert "torch.compile" in r2.stdout, r2.stdout
    assert len(compiled_by(r1.stderr)) == 1 and len(compiled_by(r2.stderr)) == 2, \
        r2.stderr[-2000:]
    one, two = train_records(one_dir), train_records(two_dir)
    assert sorted(two) == list(range(1, 7))
    gap = max(abs(one[s][k] - two[s][k]) for s in range(1, 7)
              for k in ("loss", "mlm_loss", "nsp_loss"))
    print(f"max |2 processes - 1| loss over 6 steps (impl.compile): {gap:.3g}")
    assert_same_trajectory(one, two, range(1, 7))
