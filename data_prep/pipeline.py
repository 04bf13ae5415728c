"""The prep pipeline, top to bottom: tokenizer -> tokenized corpus -> plan -> shards -> manifest.

Shards hold BERT's NSP pairs (instances.py) or, with `packing` full_sentences / doc_sentences,
MLM-only packed sentences (packing.py); both are masked the same way (masking.py).

`run(PrepConfig)` is what `bert-prep` calls (tests and benchmarks call it directly).  Every step
leaves a complete result under a final name or nothing, so re-running the same command after a
crash resumes: the saved tokenizer, the tokenized corpus and every finished shard are reused,
and `manifest.json` appears only once all shards of both splits exist.  Stopping anywhere (kill
-9, Ctrl-C, a full disk) and re-running gives the same bytes as an uninterrupted run: temp files
of a killed run are swept at the start (tests/test_prep_faults.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import platform
import re
import shutil
import sys
import time
from typing import Iterator, Optional

import numpy as np

from bert_pretrain.components.folder_lock import LOCK_FILE, first_missing
from data_prep import corpus as corpus_mod
from data_prep.config import PrepConfig
from data_prep.errors import PrepError, PrepIOError, os_error
from data_prep.instances import create_instances
from data_prep.masking import MaskingTables, assemble, mask_rows
from data_prep.packing import assemble_packed, pack_unit
from data_prep.plan import SPLIT_IDS, SPLITS, SplitPlan, make_plan
from data_prep.shards import (add_stats, is_done, read_stats, remove_crash_leftovers,
                              remove_stale_tmp, shard_path, shard_stats, stats_table, summarize,
                              tmp_suffix, write_json_atomic, write_shard)
from data_prep.token_store import TokenStore, is_complete, read_blocks, tokenize_corpus
from data_prep.tokenizer import prepare_tokenizer, vocab_shortfall
from data_prep.workers import init_worker_process

# The oldest reader that understands the output: MLM + NSP pairs are unchanged since version 1
# (so readers of version 1 still read them); MLM-only packed data needs a version-2 reader, and
# an older one refuses it by its version instead of failing on the NSP files it lacks.
FORMAT_VERSION = {"nsp_pairs": 1, "full_sentences": 2, "doc_sentences": 2}


# A word (a run between spaces and ASCII punctuation) longer than WordPiece's 100-character
# limit is encoded as [UNK], so it teaches the vocabulary nothing; and the trainer's merge loop
# is quadratic in a word's length (one 1 MB word stalls it for many minutes).  Such words are
# left out of tokenizer training only: the corpus itself is encoded as it is.
_UNUSABLE_WORD = re.compile(r"[^\s!-/:-@\[-`{-~]{101,}")


def _sentence_batches(cfg, size: int = 4096, exclude: Optional[str] = None
                      ) -> Iterator[list[str]]:
    """Corpus sentences in lists of `size`, for tokenizer training."""
    batch: list[str] = []
    for _, s in corpus_mod.read_corpus(cfg, exclude):
        if len(s) > 100:
            s = _UNUSABLE_WORD.sub(" ", s)
        batch.append(s)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def _contents(out: str) -> list:
    """What output_dir holds but for the writers' lock files (bert_pretrain's folder_lock)."""
    return [n for n in os.listdir(out) if not n.startswith(LOCK_FILE)]


def _empty(out: str) -> None:
    """Delete output_dir's contents, keeping the lock files: deleting the one this command
    holds would let a second command take a new one and write along."""
    for name in _contents(out):
        path = os.path.join(out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def _prepare_output_dir(cfg: PrepConfig, out: str, key: str) -> Optional[dict]:
    """Returns the existing manifest when this exact prep is already complete."""
    manifest = os.path.join(out, "manifest.json")
    work_cfg = os.path.join(out, ".work", "config.json")
    if os.path.isdir(out) and _contents(out):
        ours = os.path.exists(manifest) or os.path.isdir(os.path.join(out, ".work"))
        if not ours:
            raise PrepError(f"output_dir={cfg.output_dir!r} exists and is not a bert-prep output: "
                            "choose another output_dir (nothing was written)")
        if cfg.overwrite:
            _empty(out)
        else:
            old_key = None
            for path in (manifest, work_cfg):
                if os.path.exists(path):
                    with open(path) as f:
                        old_key = json.load(f).get("key")
                    break
            if old_key != key:
                if os.path.exists(manifest) or _any_shard(out):
                    raise PrepError(f"output_dir={cfg.output_dir!r} holds a prep with other "
                                    "settings or input: choose another output_dir, or add "
                                    "overwrite=true to replace it")
                # An earlier attempt that stopped before any shard: nothing worth keeping.
                _empty(out)
            elif os.path.exists(manifest):
                with open(manifest) as f:
                    return json.load(f)
    os.makedirs(os.path.join(out, ".work"), exist_ok=True)
    return None


def _file_hash(path: str) -> Optional[str]:
    """Content hash of a reused vocabulary (a file, or the candidates in a directory), so a
    vocabulary edited in place is not mistaken for the one a partial prep used."""
    paths = [path] if os.path.isfile(path) else [
        os.path.join(path, n) for n in ("tokenizer.json", "vocab.txt")
        if os.path.isfile(os.path.join(path, n))]
    if not paths:
        return None      # missing: load_tokenizer reports it
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _any_shard(out: str) -> bool:
    return any(os.path.isdir(os.path.join(out, s)) and any(
        n.startswith("shard-") for n in os.listdir(os.path.join(out, s))) for s in SPLITS)


# ---- per-shard work (runs in worker processes) ---------------------------------------------
_W: dict = {}


def _init_worker(ctx: dict) -> None:
    init_worker_process()
    _W.clear()
    _W.update(ctx)


def _build_shard(task: tuple[str, int]) -> tuple[str, int, dict]:
    # The memory maps are opened per shard and closed after it: the pages a shard touched
    # (its unit and its random-next segments, anywhere in the corpus) leave the process's
    # resident set, so a long-running worker does not grow towards the corpus size.
    store = TokenStore.open(_W["tokens_dir"])
    plan = SplitPlan.load(_W["plan_dir"], task[0], _W["dupes"][task[0]])
    try:
        return _build_shard_from(task, store, plan)
    finally:
        del store, plan


def _gather_tokens(tokens: np.ndarray, seg):
    """The tokens a shard needs, in one buffer, with the segments re-based onto it.  Every
    segment (A, actual-next B, random-next B) is read as a range of its own, neighbours
    merged (token_store.read_blocks): the buffer is about the shard's own size whatever the
    corpus size, even when the unit's documents lie far apart in the corpus."""
    n = len(seg.a_start)
    buf, pos = read_blocks(tokens, np.concatenate([seg.a_start, seg.b_start]),
                           np.concatenate([seg.a_len, seg.b_len]))
    return buf, dataclasses.replace(seg, a_start=pos[:n], b_start=pos[n:])


def _build_shard_from(task, store: TokenStore, plan: SplitPlan) -> tuple[str, int, dict]:
    split, index = task
    p = _W["params"]
    unit, dupe = plan.shard(index)
    rng = np.random.default_rng(np.random.SeedSequence(
        [p["seed"], SPLIT_IDS[split], unit, dupe]))
    if p["packing"] == "nsp_pairs":
        arrays, lengths, extra = _nsp_pairs(store, plan, unit, p, rng)
    else:
        arrays, lengths, extra = _packed(store, plan, unit, p)
    positions, labels, counts = mask_rows(arrays["input_ids"], lengths, p["masked_lm_prob"],
                                          p["max_predictions_per_seq"], p["whole_word_mask"],
                                          _W["tables"], rng)
    dtype = _W["token_dtype"]
    arrays.update(input_ids=arrays["input_ids"].astype(dtype),
                  lengths=lengths.astype(np.uint16),
                  masked_positions=positions.astype(np.uint16),
                  masked_labels=labels.astype(dtype))
    stats = shard_stats(lengths, {**extra, **counts}, p["max_seq_length"], _W["fingerprint"])
    write_shard(shard_path(_W["out"], split, index), index, arrays, stats)
    return split, index, stats


def _nsp_pairs(store: TokenStore, plan: SplitPlan, unit: int, p: dict, rng):
    """BERT's instances: (arrays, lengths, NSP counts for the stats)."""
    seg = create_instances(np.asarray(plan.unit_pieces(unit)), store.sent_off, store.doc_off,
                           plan.docs, p["max_seq_length"], p["short_seq_prob"],
                           p["random_next_prob"], rng)
    ids = assemble(*_gather_tokens(store.tokens, seg), p["max_seq_length"], _W["tables"])
    arrays = {"input_ids": ids, "segment_a_lengths": (seg.a_len + 2).astype(np.uint16),
              "next_sentence_labels": seg.is_random_next.astype(np.uint8)}
    return arrays, seg.a_len + seg.b_len + 3, {"num_random_next": int(seg.is_random_next.sum())}


def _packed(store: TokenStore, plan: SplitPlan, unit: int, p: dict):
    """MLM-only instances (packing.py): (arrays, lengths, packing counts for the stats)."""
    packed = pack_unit(plan.unit_pieces(unit), store.sent_off, p["max_seq_length"],
                       cross_documents=p["packing"] == "full_sentences")
    buf, pos = read_blocks(store.tokens, packed.run_start, packed.run_len)
    ids = assemble_packed(buf, pos, packed, p["max_seq_length"], _W["tables"])
    return {"input_ids": ids}, packed.lengths(), {"num_doc_boundaries": packed.doc_boundaries()}


def _run_tasks(tasks: list, ctx: dict, num_proc: int, progress: bool) -> None:
    from bert_pretrain.components.progress import progress_bar
    with progress_bar(len(tasks), desc="shards", unit="shard", enabled=progress) as bar:
        if num_proc == 1 or len(tasks) <= 1:
            _W.clear()
            _W.update(ctx)
            for t in tasks:
                _build_shard(t)
                bar.update()
        else:
            _run_pool(tasks, ctx, min(num_proc, len(tasks)), bar.update)


def _run_pool(tasks: list, ctx: dict, workers: int, done) -> None:
    """Shards on worker processes.  A worker that dies (the out-of-memory killer, kill -9)
    fails the run at once, where multiprocessing.Pool would wait for its shard forever; on
    an error or Ctrl-C the other workers are killed, not waited for."""
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ex = ProcessPoolExecutor(workers, mp_context=mp.get_context(method),
                             initializer=_init_worker, initargs=(ctx,))
    try:
        for future in as_completed([ex.submit(_build_shard, t) for t in tasks]):
            future.result()
            done()
    except BaseException as e:
        for proc in list((getattr(ex, "_processes", None) or {}).values()):
            proc.kill()      # half-written shards are temp dirs: the re-run deletes them
        # wait=True joins the executor's manager thread, which ends at once with its workers
        # killed.  Left running, it closes its wake-up pipe while the interpreter's exit hook
        # (concurrent.futures' _python_exit) writes to it without the lock: now and then
        # "OSError: Bad file descriptor" and a traceback after the one-line Ctrl-C message.
        ex.shutdown(wait=True, cancel_futures=True)
        if isinstance(e, BrokenProcessPool):
            raise PrepError("a worker process died while building shards (killed by the "
                            "system? running out of memory is the usual cause: lower num_proc "
                            "or tokens_per_shard), then re-run the same command to resume"
                            ) from None
        raise
    ex.shutdown(wait=True)


# ---- the pipeline ----------------------------------------------------------------------------
def nsp_balance_warning(stats: dict, random_next_prob: float) -> Optional[str]:
    """The warning for NSP pairs whose random-next share missed `random_next_prob` by more than
    sampling explains, or None.  A pair from a document with nothing after its first chunk can
    only be random; instances.py makes up for each with a true-next pair elsewhere, which a
    corpus of mostly one-sentence documents (a table's rows) cannot supply (SST-2's rows with
    IMDB reviews: 59% random), so the NSP task is then partly "is this a short document"."""
    n, got = stats.get("num_instances", 0), stats.get("nsp_random_fraction")
    if got is None or not n:
        return None
    p = random_next_prob
    if abs(got - p) <= max(0.02, 4 * (p * (1 - p) / n) ** 0.5):
        return None
    return (f"bert-prep: warning: {got:.1%} of the NSP pairs are random-next, not the {p:.0%} "
            f"asked (random_next_prob): too many documents have no second sentence to give a "
            f"true next segment (each row of a table is a document). For one-sentence documents "
            f"packing=full_sentences (MLM only, no NSP) suits; otherwise put more sentences in "
            f"each document")


def _warn_nsp_balance(stats: dict, cfg: PrepConfig) -> None:
    note = nsp_balance_warning(stats, cfg.random_next_prob) if cfg.packing == "nsp_pairs" else None
    if note:
        print(note, file=sys.stderr, flush=True)


def _versions() -> dict:
    import tokenizers
    try:
        from importlib.metadata import version
        ours = version("bert-pretrain")
    except Exception:
        ours = "unknown"
    return {"python": platform.python_version(), "numpy": np.__version__,
            "tokenizers": tokenizers.__version__, "bert_pretrain": ours}


def run(cfg: PrepConfig) -> Optional[dict]:
    """Prepare `cfg.output_dir`.  Returns the manifest, or None when this host's part is done
    but other hosts' shards are still missing."""
    out = os.path.abspath(os.path.expanduser(cfg.output_dir))
    if os.path.exists(out) and not os.path.isdir(out):
        raise PrepError(f"output_dir={cfg.output_dir!r} is an existing file, not a directory: "
                        "choose a directory path (nothing was written)")
    created = first_missing(out)
    try:
        lock = _lock(cfg, out)
    except OSError as e:
        raise os_error(e, f"output_dir={cfg.output_dir!r}", out) from None
    if cfg.packing_auto:
        print(f"bert-prep: packing={cfg.packing} (auto: " + (
            "the rows of a table are independent texts, so MLM only, whole sentences packed "
            "with [SEP] between them, no next-sentence pairs" if cfg.packing == "full_sentences"
            else "BERT's MLM + next-sentence pairs") + "; set packing= to choose)", flush=True)
    try:
        return _run(cfg, out)
    except PrepIOError:
        raise         # disk full, permissions: what is done is kept for the re-run
    except PrepError:
        if created:   # a bad input found on the first run leaves nothing behind
            shutil.rmtree(created, ignore_errors=True)  # (the parents it made included)
        raise
    except OSError as e:   # a read or write of the output dir the steps did not name
        raise os_error(e, f"output_dir={cfg.output_dir!r}", out) from None
    finally:
        lock.release()


def lock_name(cfg: PrepConfig) -> str:
    """One writer per host's part: hosts of a multi-host prep write one output_dir together,
    each its own shards, so each holds its own lock."""
    return LOCK_FILE if cfg.host_index is None else f"{LOCK_FILE}-host{cfg.host_index}"


def _lock(cfg: PrepConfig, out: str):
    """Hold output_dir's lock: a second bert-prep into it (for the same host) stops here, in one
    line, before it reads or changes anything there; one that was killed holds nothing."""
    from bert_pretrain.components.folder_lock import FolderBusy, lock_folder

    try:
        return lock_folder(out, "bert-prep", lock_name(cfg))
    except FolderBusy as e:
        raise PrepError(f"output_dir={cfg.output_dir!r}: {e}") from None


def _run(cfg: PrepConfig, out: str) -> Optional[dict]:
    work = os.path.join(out, ".work")
    ident = {"config": cfg.result_dict(), "corpus": corpus_mod.fingerprint(cfg.corpus, out)}
    if "files" in ident["corpus"] and not ident["corpus"]["files"]:
        raise PrepError("corpus.paths names no file outside output_dir: check corpus.paths")
    if cfg.tokenizer.vocab_file:
        ident["vocab_sha256"] = _file_hash(os.path.expanduser(cfg.tokenizer.vocab_file))
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    done = _prepare_output_dir(cfg, out, key)
    for d in (out, work, *(os.path.join(out, s) for s in SPLITS)):
        remove_crash_leftovers(d)     # temp files of a run killed mid-write (kill -9)
    if done is not None:
        columns = {s: done["splits"][s]["stats"] for s in SPLITS}
        print(stats_table({**columns, "all": done["stats"]}))
        _warn_nsp_balance(done["stats"], cfg)
        print(f"bert-prep: {cfg.output_dir} is already complete; nothing to do")
        return done
    state = os.path.join(work, "config.json")
    resume = os.path.exists(state)
    if not resume:
        write_json_atomic(state, {"key": key, **ident})
    # encode_batch runs on num_proc Rust threads.  Saying so explicitly also silences the
    # fork warning of `tokenizers`: fork()ed tokenization workers switch parallelism off
    # themselves (token_store._init_encoder) and shard workers never tokenize.
    os.environ.setdefault("RAYON_NUM_THREADS", str(cfg.num_proc))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

    timings = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 3)
        clock = now

    tok = prepare_tokenizer(cfg.tokenizer, lambda: _sentence_batches(cfg.corpus, exclude=out),
                            os.path.join(out, "tokenizer"), cfg.progress, reuse_saved=resume)
    fingerprint = hashlib.sha256((key + tok.sha256).encode()).hexdigest()[:16]

    lap("tokenizer")
    tokens_dir = os.path.join(work, "tokens")
    if is_complete(tokens_dir):
        store = TokenStore.open(tokens_dir)
    else:
        store = tokenize_corpus(corpus_mod.read_corpus(cfg.corpus, out), tok.tokenizer,
                                tokens_dir, tok.token_dtype, cfg.tokenize_batch_size,
                                cfg.progress, cfg.num_proc)

    lap("tokenize")
    plan_dir = os.path.join(work, "plan")
    if not os.path.isdir(plan_dir):
        plans = make_plan(store, cfg.validation_fraction, cfg.tokens_per_shard,
                          cfg.dupe_factor, cfg.seed, cfg.next_sentence_prediction,
                          corpus_mod.how_to_get_more_documents(cfg.corpus))
        tmp = plan_dir + tmp_suffix()
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.makedirs(tmp)
            for p in plans.values():
                p.save(tmp)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise os_error(e, "writing the plan (.work/plan)", out) from None
        try:
            os.rename(tmp, plan_dir)
        except OSError:   # another host saved the same plan first
            shutil.rmtree(tmp, ignore_errors=True)
    counts = {"num_documents": store.num_documents, "num_sentences": store.num_sentences,
              "num_tokens": store.num_tokens}
    del store   # unmap: the workers open their own views, shard by shard
    dupes = {"train": cfg.dupe_factor, "validation": 1}
    plans = {s: SplitPlan.load(plan_dir, s, dupes[s]) for s in SPLITS}

    # Shards of this host: numbered across both splits, dealt round-robin over hosts.
    all_shards = [(s, i) for s in SPLITS for i in range(plans[s].num_shards)]
    mine = [t for n, t in enumerate(all_shards)
            if cfg.host_index is None or n % cfg.num_hosts == cfg.host_index]
    todo = [t for t in mine if not is_done(shard_path(out, *t))]
    for s in SPLITS:
        remove_stale_tmp(out, s, {i for split, i in todo if split == s})
    special = tok.special_mask()
    tables = MaskingTables(special, tok.continuation_mask(),
                           np.flatnonzero(~special).astype(np.int32),
                           tok.special_ids["pad"], tok.special_ids["cls"],
                           tok.special_ids["sep"], tok.special_ids["mask"])
    params = {k: getattr(cfg, k) for k in ("packing", "seed", "max_seq_length",
                                           "short_seq_prob", "random_next_prob",
                                           "masked_lm_prob", "max_predictions_per_seq",
                                           "whole_word_mask")}
    ctx = {"tokens_dir": tokens_dir, "plan_dir": plan_dir, "dupes": dupes, "params": params,
           "tables": tables, "token_dtype": tok.token_dtype, "fingerprint": fingerprint,
           "out": out}
    if cfg.progress and len(todo) < len(mine):
        print(f"bert-prep: resuming: {len(mine) - len(todo)} of {len(mine)} shards already done")
    lap("plan")
    _run_tasks(todo, ctx, cfg.num_proc, cfg.progress)
    lap("shards")

    missing = [t for t in all_shards if not is_done(shard_path(out, *t))]
    if missing:
        print(f"bert-prep: host {cfg.host_index} of {cfg.num_hosts} done; "
              f"{len(all_shards) - len(missing)} of {len(all_shards)} shards exist. Once every "
              "host has finished, run the same command without host_index to write the manifest")
        return None
    return _write_manifest(cfg, out, key, fingerprint, tok, counts, plans, timings)


def _write_manifest(cfg, out, key, fingerprint, tok, counts, plans, timings) -> dict:
    # Shard statistics are added up as they are read: memory stays flat however many shards.
    splits, per_split, everything = {}, {}, []
    packed = not cfg.next_sentence_prediction
    for s in SPLITS:
        shards, split_total = [], []
        for i in range(plans[s].num_shards):
            st = read_stats(shard_path(out, s, i))
            if st["fingerprint"] != fingerprint:
                raise PrepError(f"{shard_path(out, s, i)} was made by another prep (tokenizer or "
                                "settings differ): delete it and re-run")
            add_stats(split_total, st)
            add_stats(everything, st)
            if st["num_instances"]:
                shards.append({"path": f"{s}/shard-{i:05d}", "num_instances": st["num_instances"]})
        per_split[s] = summarize(split_total, cfg.max_seq_length, packed)
        splits[s] = {"num_instances": per_split[s]["num_instances"], "shards": shards,
                     "num_documents": int(len(plans[s].docs)), "stats": per_split[s]}
    stats = summarize(everything, cfg.max_seq_length, packed)
    manifest = {
        "format_version": FORMAT_VERSION[cfg.packing], "complete": True, "key": key,
        "fingerprint": fingerprint,
        # What the data trains: "mlm_nsp" (pairs with NSP labels) or "mlm" (no NSP label, no
        # second segment); a manifest without the key is an "mlm_nsp" one.
        "objective": "mlm_nsp" if cfg.next_sentence_prediction else "mlm",
        "packing": cfg.packing,
        "max_seq_length": cfg.max_seq_length,
        "max_predictions_per_seq": cfg.max_predictions_per_seq,
        "vocab_size": tok.vocab_size, "token_dtype": tok.token_dtype,
        "special_token_ids": tok.special_ids,
        "tokenizer": {"path": "tokenizer", "sha256": tok.sha256,
                      "do_lower_case": tok.do_lower_case,
                      # trained: what was asked, and why fewer pieces came out (or null)
                      **({} if cfg.tokenizer.vocab_file else {
                          "vocab_size_asked": cfg.tokenizer.vocab_size,
                          "vocab_shortfall": vocab_shortfall(cfg.tokenizer, tok.vocab_size)})},
        "splits": splits,
        "masking": {"masked_lm_prob": cfg.masked_lm_prob, "whole_word_mask": cfg.whole_word_mask,
                    "max_predictions_per_seq": cfg.max_predictions_per_seq},
        "seed": cfg.seed, "dupe_factor": cfg.dupe_factor,
        "config": cfg.to_dict(),
        "counts": counts,
        "stats": stats,
        "versions": _versions(),
        # Seconds per step of the run that wrote the manifest (a resumed run skips steps).
        "timings_s": timings,
    }
    write_json_atomic(os.path.join(out, "manifest.json"), manifest)
    # The statistics table is the run's report: always printed.
    print(stats_table({"train": per_split["train"], "validation": per_split["validation"],
                       "all": stats}))
    _warn_nsp_balance(stats, cfg)
    short = "" if cfg.tokenizer.vocab_file or tok.vocab_size >= cfg.tokenizer.vocab_size else \
        f" of the {cfg.tokenizer.vocab_size:,} asked (see the warning above)"
    print(f"bert-prep: wrote {stats['num_instances']:,} instances to {cfg.output_dir}; "
          f"vocabulary: {tok.vocab_size:,} pieces{short}")
    return manifest
