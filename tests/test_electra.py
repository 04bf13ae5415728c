"""ELECTRA's replaced-token detection (`model.generator_layers > 0`): what the generator writes
into the encoder's input, how the sampling follows its predictions, where each loss's gradient
goes, and the paths around it: bert-train (evaluation, exact resume), continued pretraining,
bert-export and fine-tuning's encoder."""

import dataclasses
import json
import os
import shutil

import pytest
import torch

from bert_pretrain.components import checkpoint as ckpt
from bert_pretrain.errors import UserError
from bert_pretrain.model import BertConfig, BertForPreTraining, ModelImpl
from bert_pretrain.tools.export import export
from train_support import read_metrics, train_in_process, write_prepared

pytestmark = pytest.mark.usefixtures("one_thread")

V = 40


def _model(unpad=True, nsp=False, seed=0, **extra):
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        next_sentence_prediction=nsp, generator_layers=1, **extra)
    return BertForPreTraining(config, ModelImpl(unpad=unpad))


def _batch(b=4, n=12, seed=1):
    """Ids 5..V-1 after a [CLS] (2); sequence 1 padded from position 8; a few labelled
    positions per sequence, shown as [MASK] (4)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (b, n), generator=g)
    ids[:, 0] = 2
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    ids[1, 8:] = 0
    labels = torch.full_like(ids, -100)
    for row, cols in enumerate([(1, 4), (2, 5, 7), (3,), (6, 9, 10, 11)][:b]):
        for col in cols:
            labels[row, col] = ids[row, col]
            ids[row, col] = 4
    return ids, mask, labels


def _inputs_seen(model):
    """The input ids of each call of the shared embedding layer: [generator's, encoder's]."""
    seen = []
    model.bert.embeddings.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    return seen


def test_generator_layers_is_checked():
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"model.generator_layers must be an integer >= 0"):
            BertConfig(vocab_size=V, generator_layers=bad)
    # the exported config is a plain transformers BertConfig
    assert "generator_layers" not in BertConfig(vocab_size=V, generator_layers=1).to_hf_dict()


def test_the_encoder_reads_the_samples_at_the_labelled_positions_only():
    model = _model()
    seen = _inputs_seen(model)
    ids, mask, labels = _batch()
    out = model(ids, mask, labels=labels)
    shown, corrupted = seen
    assert torch.equal(shown, ids)                     # the generator reads the masked input
    labelled = labels != -100
    assert torch.equal(corrupted[~labelled], ids[~labelled])   # elsewhere: untouched
    assert not (corrupted[labelled] == 4).any()        # every [MASK] filled with a sample
    original = torch.where(labelled, labels, ids)
    replaced = (corrupted != original)[mask.bool()].float()
    assert torch.equal(out.rtd_labels, replaced)       # the targets: real tokens, row-major
    assert out.rtd_logits.shape == (int(mask.sum()),)
    assert out.prediction_logits.shape == (int(labelled.sum()), V)   # the generator's, sparse
    assert torch.equal(out.mlm_labels, labels[labelled])
    assert torch.allclose(out.loss, out.mlm_loss + out.rtd_loss)


def test_a_sample_equal_to_the_original_is_not_replaced():
    model = _model()
    seen = _inputs_seen(model)
    ids, mask, labels = _batch()
    with torch.no_grad():   # the generator can only predict token 7: logits = its bias alone
        model.bert.embeddings.word_embeddings.weight.zero_()
        model.cls.predictions.bias.fill_(-1e4)
        model.cls.predictions.bias[7] = 0.0
    labels[labels != -100] = 7
    labels[0, 1] = 9
    out = model(ids, mask, labels=labels)
    corrupted = seen[1]
    assert (corrupted[labels != -100] == 7).all()
    grid = torch.zeros_like(ids, dtype=torch.float)
    grid[0, 1] = 1.0                                   # the only position that changed
    assert torch.equal(out.rtd_labels, grid[mask.bool()])


def test_samples_follow_the_generators_distribution():
    """Gumbel-max draws from softmax(logits): frequencies within 0.03 of the probabilities over
    4,000 draws (3 standard deviations of the largest is 0.024)."""
    model = _model()
    seen = _inputs_seen(model)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    tokens = torch.tensor([11, 12, 13, 14])
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight.zero_()
        model.cls.predictions.bias.fill_(-1e4)
        model.cls.predictions.bias[tokens] = p.log()
    ids = torch.full((100, 41), 4)
    ids[:, 0] = 2
    labels = torch.full_like(ids, 20)
    labels[:, 0] = -100
    torch.manual_seed(5)
    model(ids, torch.ones_like(ids), labels=labels)
    drawn = seen[1][:, 1:].reshape(-1)
    assert drawn.numel() == 4000
    freq = torch.stack([(drawn == t).float().mean() for t in tokens])
    assert freq.sum() == 1.0
    assert (freq - p).abs().max() < 0.03, freq


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward(retain_graph=True)
    parts = {"embeddings": model.bert.embeddings, "encoder": model.bert.encoder,
             "generator": model.generator, "mlm head": model.cls.predictions.transform,
             "detection head": model.discriminator_predictions}
    return {name: sum(float(p.grad.abs().sum()) for p in part.parameters()
                      if p.grad is not None) for name, part in parts.items()}


def test_each_loss_trains_its_own_network_and_both_the_embeddings():
    model = _model()
    ids, mask, labels = _batch()
    out = model(ids, mask, labels=labels)
    mlm = _grads(model, out.mlm_loss)
    rtd = _grads(model, out.rtd_loss)
    assert mlm["generator"] > 0 and mlm["mlm head"] > 0 and mlm["embeddings"] > 0
    assert mlm["encoder"] == 0 and mlm["detection head"] == 0   # no gradient through sampling
    assert rtd["encoder"] > 0 and rtd["detection head"] > 0 and rtd["embeddings"] > 0
    assert rtd["generator"] == 0 and rtd["mlm head"] == 0


@pytest.mark.parametrize("nsp", [False, True])
def test_padded_and_unpadded_paths_agree(nsp):
    ids, mask, labels = _batch()
    outs = []
    for unpad in (True, False):
        model = _model(unpad=unpad, nsp=nsp)
        torch.manual_seed(3)
        outs.append(model(ids, mask, labels=labels,
                          next_sentence_label=torch.tensor([0, 1, 0, 1]) if nsp else None))
    a, b = outs
    for name in ("mlm_loss", "rtd_loss", "rtd_logits", "rtd_labels"):
        assert torch.allclose(getattr(a, name), getattr(b, name), atol=1e-5), name
    if nsp:
        assert torch.allclose(a.nsp_loss, b.nsp_loss, atol=1e-5)


def test_fill_mask_runs_the_generator():
    """Without labels the MLM logits are the generator's (the head it was trained with), and
    the encoder reads the input as it is."""
    model = _model().eval()
    seen = _inputs_seen(model)
    ids, mask, _ = _batch()
    with torch.no_grad():
        out = model(ids, mask)
        from bert_pretrain.model import TokenLayout

        layout = TokenLayout.build(mask, *ids.shape, True)
        gen, _, _ = model.generator(model.bert.embeddings(ids, None, layout), layout)
        want = model.cls.predictions(layout.to_grid(gen))
    assert out.prediction_logits.shape == (*ids.shape, V)
    assert torch.allclose(out.prediction_logits, want, atol=1e-6)
    assert torch.equal(seen[0], ids) and torch.equal(seen[1], ids)
    assert out.rtd_loss is None


# ------------------------------------------------------------------------------ bert-train


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return write_prepared(str(tmp_path_factory.mktemp("prep")), num_train=40, num_valid=8)


COMMON = ["experiment=smoke", "model.generator_layers=1", "trainer.max_steps=8",
          "trainer.checkpoint_every=4", "trainer.keep_last_k=10", "trainer.eval_every=4",
          "trainer.micro_batch_size=4", "data.masking=dynamic"]


def _records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir)}


def test_bert_train_evaluates_detection_and_resumes_bit_exact(tmp_path, prepared):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    train_in_process(COMMON + [f"data.dir={prepared}", f"run_dir={full}"])
    os.makedirs(os.path.join(part, "checkpoints"))
    shutil.copytree(os.path.join(full, "checkpoints", "step-00000004"),
                    os.path.join(part, "checkpoints", "step-00000004"))
    train_in_process(COMMON + [f"data.dir={prepared}", f"run_dir={part}", "resume=auto"])
    a = [r for r in read_metrics(full)]
    evals = [r for r in a if "eval_rtd_accuracy" in r]
    assert [r["step"] for r in evals] == [4, 8]
    assert all(0.0 <= r["eval_rtd_accuracy"] <= 1.0 and r["eval_rtd_loss"] > 0 for r in evals)
    train_a = {r["step"]: r["loss"] for r in a if "loss" in r}
    train_b = {r["step"]: r["loss"] for r in read_metrics(part) if "loss" in r}
    assert train_b and all(train_a[s] == train_b[s] for s in train_b)
    # the logged loss holds the detection loss: it is above the MLM + NSP parts
    rec = [r for r in a if "loss" in r][-1]
    assert rec["loss"] > rec["mlm_loss"] + rec["nsp_loss"]
    # the resumed run's evaluation is the uninterrupted one's (sampling from a fixed seed)
    eval_b = [r for r in read_metrics(part) if "eval_rtd_accuracy" in r]
    assert eval_b[-1]["eval_rtd_loss"] == evals[-1]["eval_rtd_loss"]
    final = os.path.join(full, "checkpoints", "step-00000008")
    with open(os.path.join(final, "trainer_state.json")) as f:
        assert json.load(f)["model_config"]["generator_layers"] == 1


def test_continued_pretraining_switches_the_generator_on_and_off(tmp_path, prepared):
    """trainer.init_from: an MLM run continued with a generator (which starts fresh), and an
    ELECTRA run continued as a plain MLM (its generator is dropped; the encoder is kept)."""
    mlm, electra = str(tmp_path / "mlm"), str(tmp_path / "electra")
    base = ["experiment=smoke", f"data.dir={prepared}", "trainer.max_steps=3",
            "trainer.warmup_steps=1",
            "trainer.eval_every=0", "trainer.checkpoint_every=3"]
    train_in_process(base + [f"run_dir={mlm}"])
    train_in_process(base + [f"run_dir={electra}", "model.generator_layers=1",
                             f"trainer.init_from={mlm}"])
    back = str(tmp_path / "back")
    train_in_process(base + [f"run_dir={back}", f"trainer.init_from={electra}"])
    with open(os.path.join(back, "checkpoints", "step-00000003", "trainer_state.json")) as f:
        assert json.load(f)["model_config"]["generator_layers"] == 0


def test_export_takes_the_encoder_and_refuses_the_generators_head(tmp_path, prepared):
    run = str(tmp_path / "run")
    train_in_process(COMMON + [f"data.dir={prepared}", f"run_dir={run}",
                               "trainer.max_steps=2", "trainer.warmup_steps=1",
                               "trainer.eval_every=0"])
    with pytest.raises(UserError, match=r"ELECTRA generator .* export --head encoder"):
        export(run, str(tmp_path / "pre"))
    assert not os.path.exists(tmp_path / "pre")
    export(run, str(tmp_path / "enc"), head="encoder")
    with open(tmp_path / "enc" / "config.json") as f:
        config = json.load(f)
    assert config["architectures"] == ["BertModel"] and "generator_layers" not in config
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "enc" / "model.safetensors"))
    checkpoint = ckpt.read_train_state(os.path.join(run, "checkpoints", "step-00000002"))
    model = BertForPreTraining(BertConfig.from_dict(checkpoint["model_config"]))
    ckpt.load_weights(os.path.join(run, "checkpoints", "step-00000002"), model)
    model.eval()
    encoder = {k[len("bert."):]: v for k, v in model.state_dict().items()
               if k.startswith("bert.")}
    assert set(exported) <= set(encoder) and "embeddings.word_embeddings.weight" in exported
    assert not any(k.startswith(("generator", "discriminator")) for k in exported)
    for k, v in exported.items():
        assert torch.equal(v, encoder[k]), k
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertModel.from_pretrained(str(tmp_path / "enc")).eval()
    ids, mask, _ = _batch()
    ids = ids.clamp(max=hf.config.vocab_size - 1)
    with torch.no_grad():
        ours = model.bert(ids, mask)
        theirs = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.allclose(ours.layout.to_grid(ours.sequence_output)[mask.bool()],
                          theirs[mask.bool()], atol=1e-4)
    # fine-tuning starts from the same encoder
    from bert_pretrain.finetune.pretrained import load_pretrained

    pretrained = load_pretrained(run)
    assert set(pretrained.encoder_state) == {"bert." + k for k in encoder}
    for k, v in pretrained.encoder_state.items():
        assert torch.equal(v, encoder[k[len("bert."):]]), k


@pytest.mark.slow
def test_two_processes_train_it_and_fsdp_is_refused_in_one_line(tmp_path):
    """Under bert-launch (2 CPU processes, gloo): DDP trains it (every parameter gets a
    gradient each step: the generator from the MLM loss, the detection head from its own), and
    FSDP, which would leave the generator unwrapped in its root unit, is refused."""
    from test_cli_launch_errors import _launch

    r = _launch(tmp_path / "ddp", "bert_pretrain.tools.launch", "model.generator_layers=1",
                "trainer.max_steps=3", "trainer.warmup_steps=1", "trainer.eval_every=3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 process(es)" in r.stdout and "replaced-token detection accuracy" in r.stdout
    r = _launch(tmp_path / "fsdp", "bert_pretrain.tools.launch", "model.generator_layers=1",
                "trainer.sharding=fsdp")
    assert r.returncode == 2, r.stdout + r.stderr
    assert (r.stdout + r.stderr).strip().splitlines() == [
        "bert-train: error: model.generator_layers > 0 (ELECTRA) is not supported with FSDP "
        "(trainer.sharding resolved to fsdp); use trainer.sharding=ddp"]


@pytest.mark.parametrize("answer", ["always replaced", "never replaced"])
def test_evaluation_scores_detection_against_its_baseline(prepared, answer):
    """A detector forced to one answer: "never" scores exactly the baseline and finds no
    replaced token, "always" scores 1 - baseline and finds them all; and the evaluation is the
    same twice (sampling from a fixed seed), leaving the caller's random stream untouched."""
    from bert_pretrain.components.data import DataConfig, PreparedData, eval_batches
    from bert_pretrain.components.evaluation import evaluate
    from test_mlm_only import _OneProcess

    data = PreparedData(prepared)
    model = BertForPreTraining(dataclasses.replace(_model(nsp=True).config,
                                                   vocab_size=data.vocab_size))
    with torch.no_grad():
        model.discriminator_predictions.dense_prediction.weight.zero_()
        model.discriminator_predictions.dense_prediction.bias.fill_(
            100.0 if answer == "always replaced" else -100.0)

    def run():
        return evaluate(model, _OneProcess(), eval_batches(data, DataConfig(dir=prepared), 4, 1,
                                                           0, 8))
    torch.manual_seed(11)
    first = run()
    after = torch.rand(1)
    torch.manual_seed(11)
    assert run() == first and torch.equal(torch.rand(1), after)
    base = first["eval_rtd_accuracy_baseline"]
    assert 0.5 < base < 1.0
    if answer == "never replaced":
        assert first["eval_rtd_accuracy"] == pytest.approx(base) and first["eval_rtd_recall"] == 0
    else:
        assert first["eval_rtd_accuracy"] == pytest.approx(1 - base)
        assert first["eval_rtd_recall"] == 1.0


def test_a_detector_that_finds_nothing_is_warned_about():
    from bert_pretrain.components.runlog import STALL_WARNING_STEP, detection_stall_warning

    stuck = {"eval_rtd_recall": 0.0, "eval_rtd_accuracy": 0.8795,
             "eval_rtd_accuracy_baseline": 0.8795}
    assert detection_stall_warning(STALL_WARNING_STEP - 1, stuck) is None
    line = detection_stall_warning(STALL_WARNING_STEP, stuck)
    assert line.startswith(f"bert-train: warning: step {STALL_WARNING_STEP}: the encoder finds "
                           f"0.0000 of the replaced tokens")
    assert "trainer.rtd_loss_weight" in line and "\n" not in line
    assert detection_stall_warning(STALL_WARNING_STEP, {**stuck, "eval_rtd_recall": 0.2}) is None
    assert detection_stall_warning(STALL_WARNING_STEP, {"eval_mlm_accuracy": 0.3}) is None


def test_every_speed_switch_computes_the_same_electra_step():
    """The generator and the encoder run through the same speed paths (unpadding, length
    groups, nested attention, gradient checkpointing, fused QKV, SDPA): each combination gives
    the plain path's two losses and gradient, so no pair of switches crashes or differs."""
    import itertools

    reference = None
    for unpad, varlen, checkpointing, fused, attention in itertools.product(
            [True, False], ["groups", "nested", "off"], [False, True], [False, True],
            ["eager", "sdpa"]):
        if not unpad and varlen != "off":
            continue
        torch.manual_seed(0)
        config = _model().config
        model = BertForPreTraining(config, ModelImpl(
            unpad=unpad, varlen_attention=varlen, gradient_checkpointing=checkpointing,
            fused_qkv=fused, attention=attention)).train()
        ids, mask, labels = _batch()
        torch.manual_seed(3)
        out = model(ids, mask, labels=labels)
        (out.mlm_loss + out.rtd_loss).backward()
        got = torch.stack([out.mlm_loss.detach(), out.rtd_loss.detach(),
                           model.bert.encoder.layer[0].output.dense.weight.grad.norm(),
                           model.generator.layer[0].output.dense.weight.grad.norm()])
        reference = got if reference is None else reference
        assert torch.allclose(got, reference, atol=1e-4), (unpad, varlen, checkpointing, fused,
                                                           attention, got, reference)
