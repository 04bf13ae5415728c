"""Shared fixtures.  Data-prep fixtures are prefixed `prep_`."""
from __future__ import annotations

import os
import random

import pytest

import time_limits
from bert_pretrain.components.cpu_runtime import BUSY_CHECK_ENV

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """Each test's pytest-timeout budget, for time_limits.hang_limit(); returns None so that
    pytest-timeout still sets its own timer."""
    time_limits.start_budget(settings.timeout)


def pytest_runtest_logfinish(nodeid, location):
    time_limits.start_budget(None)  # the next test may have no timeout at all


# Slow tests train for minutes (24 kill-and-resume cycles, the README's first hour): their
# hang budget is this many times pyproject's per-test `timeout`.
SLOW_BUDGET_FACTOR = 4


def pytest_addoption(parser):
    parser.addoption("--cuda", action="store_true",
                     help="keep the GPU visible and run the tests marked cuda (make test-cuda); "
                          "without it the suite runs on the CPU whatever the machine has")
    parser.addoption("--failure-log", default=None, metavar="FILE",
                     help="append each failing test's report to FILE as it fails (a run cut "
                          "short by a time limit keeps its tracebacks; make gpu-check)")


def pytest_runtest_logreport(report):
    """--failure-log: the failure, written when it happens rather than in the summary at the
    end (with pytest-xdist the workers' reports arrive here, in the controller)."""
    path = _FAILURE_LOG.get("path")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


_FAILURE_LOG: dict = {}


def pytest_configure(config):
    """The default suite is the CPU suite, on every machine: its tests assert CPU results
    (bit-exact resumes, fp32 tolerances, CPU precision policies), and a visible GPU would move
    every bert-train they start onto it (29 failures on an H100, issue 30).  Hiding the GPU
    here, before anything initialises CUDA, reaches the subprocesses too.  The GPU's own tests
    are marked `cuda` and run with --cuda (tests/test_cuda.py)."""
    if not config.getoption("--cuda"):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # bert-train's busy-machine warning reads how busy the machine is: the suite's own parallel
    # workers would put it into logs that tests compare, so it stays off for them (its own
    # tests count real threads, or feed it a count; the subprocesses inherit this)
    os.environ[BUSY_CHECK_ENV] = "0"
    if config.getoption("--failure-log") and not hasattr(config, "workerinput"):
        _FAILURE_LOG["path"] = config.getoption("--failure-log")  # the controller writes


def pytest_collection_modifyitems(config, items):
    """cuda tests are skipped unless the run asked for them (--cuda) on a machine with CUDA.
    Slow tests get SLOW_BUDGET_FACTOR x the configured per-test timeout, unless the user
    chose one (--timeout, PYTEST_TIMEOUT) or the test names its own."""
    _skip_cuda_tests(config, items)
    try:
        base = float(config.getini("timeout") or 0)  # ValueError without pytest-timeout
    except ValueError:
        return
    if not base or config.getoption("timeout", None) is not None or \
            os.environ.get("PYTEST_TIMEOUT"):
        return
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_BUDGET_FACTOR * base))


def _skip_cuda_tests(config, items) -> None:
    """Without --cuda the cuda tests are skipped; with it, every other test is (it asserts CPU
    results and would now see the GPU: --cuda runs the GPU tests only)."""
    if config.getoption("--cuda"):
        cpu_only = pytest.mark.skip(reason="a CPU test: run without --cuda (the GPU stays "
                                           "hidden then)")
        for item in items:
            if not item.get_closest_marker("cuda"):
                item.add_marker(cpu_only)
    reason = None
    if not config.getoption("--cuda"):
        reason = "a GPU test: run with --cuda on a GPU machine (make test-cuda)"
    else:
        import torch

        if not torch.cuda.is_available():
            reason = "--cuda given but torch sees no CUDA device"
    if reason:
        for item in items:
            if item.get_closest_marker("cuda"):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def prep_compose():
    """prep_compose(*overrides) -> a validated PrepConfig composed from conf/prep/prep.yaml."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from data_prep.config import PrepConfig

    def make(*overrides: str) -> PrepConfig:
        with initialize_config_dir(os.path.join(REPO, "conf", "prep"), version_base="1.3"):
            cfg = compose("prep", overrides=["progress=false", *overrides])
        return PrepConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    return make


def _write_builtin_text(path) -> int:
    """The builtin corpus (Python's own documentation, data_prep/builtin_corpus.py: always
    there, no download) in BERT's text format: one sentence per line, a blank line between
    documents.  Returns the number of documents."""
    from data_prep.config import BuiltinCorpusConfig
    from data_prep.corpus import read_builtin
    docs: list[list[str]] = []
    for new_doc, sentence in read_builtin(BuiltinCorpusConfig()):
        if new_doc:
            docs.append([])
        docs[-1].append(sentence)
    path.write_text("\n\n".join("\n".join(d) for d in docs) + "\n", encoding="utf-8")
    return len(docs)


@pytest.fixture(scope="session")
def prep_builtin_text(tmp_path_factory):
    """(path, num_documents) of the whole builtin corpus as a text file (572 documents,
    ~1.8 MB, ~400k tokens)."""
    path = tmp_path_factory.mktemp("prep_builtin") / "builtin.txt"
    n = _write_builtin_text(path)
    assert n > 500 and path.stat().st_size > 1_500_000, "the builtin corpus shrank"
    return str(path), n


@pytest.fixture(scope="session")
def prep_vocab(tmp_path_factory, prep_builtin_text):
    """A WordPiece vocab (8k) trained on the builtin corpus: the tokenizer/ dir."""
    from data_prep.config import TextCorpusConfig, TokenizerConfig
    from data_prep.pipeline import _sentence_batches
    from data_prep.tokenizer import prepare_tokenizer
    d = tmp_path_factory.mktemp("prep_vocab") / "tokenizer"
    prepare_tokenizer(TokenizerConfig(vocab_size=8000),
                      lambda: _sentence_batches(TextCorpusConfig(paths=[prep_builtin_text[0]])),
                      str(d), progress=False)
    return str(d)


def _tagged_corpus(path, num_docs=40, seed=0):
    """Documents whose every other token names the document (d<i>) and the others the
    sentence (k<j>), so an instance tells which document and sentence each segment is from.
    Lengths mix short sentences, sentences longer than max_seq_length=64, and documents of one
    or two sentences, to exercise truncation and single-sentence chunks."""
    rng = random.Random(seed)
    docs = []
    for d in range(num_docs):
        n_sent = rng.choice([1, 2, rng.randint(3, 40)])
        doc = []
        for k in range(n_sent):
            n = rng.choice([rng.randint(1, 12), rng.randint(10, 40), rng.randint(60, 150)])
            doc.append(" ".join(f"d{d}" if j % 2 else f"k{k}" for j in range(n)))
        docs.append("\n".join(doc))
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")


@pytest.fixture(scope="session")
def prep_tagged(tmp_path_factory):
    """(corpus path, vocab.txt path) of the tagged synthetic corpus."""
    d = tmp_path_factory.mktemp("prep_tagged")
    corpus = d / "tagged.txt"
    _tagged_corpus(corpus)
    vocab = d / "vocab.txt"
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens += [f"d{i}" for i in range(40)] + [f"k{i}" for i in range(40)]
    vocab.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return str(corpus), str(vocab)


@pytest.fixture(scope="session")
def prep_small(tmp_path_factory, prep_builtin_text):
    """The first 60 sentences of each builtin document whose text is long enough to give
    instances (~0.8 MB): the masking and tokenizer tests' corpus."""
    docs = open(prep_builtin_text[0], encoding="utf-8").read().split("\n\n")
    path = tmp_path_factory.mktemp("prep_small") / "small.txt"
    path.write_text("\n\n".join("\n".join(d.split("\n")[:60]) for d in docs),
                    encoding="utf-8")
    return str(path)


@pytest.fixture
def one_thread():
    """Tiny tensors gain nothing from a second thread, and on a shared 2-core machine each
    OpenMP region can stall on a descheduled partner; one thread keeps such tests fast."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def drawn_figures(monkeypatch):
    """The matplotlib figures bert_pretrain.tools.plotting saves during the test, drawn and kept open
    for the test to read (titles, legends, ticks, texts), as well as written as PNGs."""
    from bert_pretrain.tools import plotting

    figures = []
    real = plotting.save

    def keep(fig, path):
        fig.canvas.draw()
        figures.append(fig)
        return real(fig, path)
    monkeypatch.setattr(plotting, "save", keep)
    return figures
