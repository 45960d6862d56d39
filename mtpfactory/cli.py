"""`python -m mtpfactory +head=NAME [overrides]`: build the head, prefill a few synthetic sequences, draft
k tokens for them, and print per-step time and KV blocks in use. With `-m`, one row per run and a table
comparing the runs at the end; a refused combination is a row with its reason, and the sweep goes on."""

from __future__ import annotations

import logging
import sys
import time

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig

import mtpfactory
from mtpfactory import registry
from mtpfactory.build import weights_seed
from mtpfactory.config import GROUPS, check_overrides, list_heads, options, value_text
from mtpfactory.errors import ConfigError, MtpfError

log = logging.getLogger("mtpfactory")
_rows: list[dict[str, str]] = []   # one a run; a sweep's (`-m`) each with "sweep" set
_swept: set[str] = set()           # the keys this invocation's overrides give several values (`weights=a,b`)
USAGE = "usage: python -m mtpfactory +head=NAME [group=option ...] [key=value ...] [-m for a sweep]"


@hydra.main(config_path="pkg://mtpfactory.conf", config_name="config", version_base="1.3")
def _run(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    row = {"run": " ".join(hc.overrides.task)}
    if hc.mode == RunMode.MULTIRUN:
        row["sweep"] = "yes"
    _rows.append(row)
    try:  # the demo's own calls can refuse too (a full KV pool, an op with no provider under backend=triton)
        mtpfactory.config.check_keys(cfg)
        mtpfactory.config.resolve(cfg)
        if {"weights", "weights.source"} & _swept and cfg.weights.source == "synthetic" and cfg.weights.path:
            # a sweep over the weights' sources: its weights.path is its checkpoint runs' (build_head refuses a
            # path beside synthetic weights, which a single run means as a checkpoint)
            log.info("weights.path=%s is read by the sweep's weights=checkpoint runs, not this synthetic one",
                     cfg.weights.path)
            cfg.weights.path = None
        _check_demo(cfg)
        row |= _demo(cfg, mtpfactory.build_head(cfg))
    except MtpfError as e:
        log.error("refused: %s", e)
        row["result"] = f"refused: {e}"
        return
    print(f"prefill {row['prefill ms/row']} ms/row, step {row['step ms']} ms, KV blocks in use "
          f"{row['KV blocks']}, drafts {row['drafts']}")


def _check_demo(cfg: DictConfig) -> None:
    d = cfg.demo
    for key, value in (("demo.sequences", d.sequences), ("demo.prompt_len", d.prompt_len), ("demo.k", d.k)):
        if value < 1:
            raise ConfigError(key, value, "must be >= 1", "use the default (mtpfactory/config/schema.py)")
    if cfg.runtime.max_seq_len < d.k + 2:  # at least one prefilled row, then k drafts
        raise ConfigError("demo.k", d.k, f"needs runtime.max_seq_len >= demo.k + 2 "
                          f"(runtime.max_seq_len={cfg.runtime.max_seq_len})",
                          "lower demo.k or raise runtime.max_seq_len")


def _demo(cfg: DictConfig, head: mtpfactory.DraftHead) -> dict[str, str]:
    """Prefill `demo.sequences` synthetic sequences, then propose `demo.k` tokens for all of them; each timed
    after a warm-up of the same calls."""
    d, dev = cfg.demo, head.device
    g = torch.Generator().manual_seed(weights_seed(cfg) + 1)
    n = min(d.sequences, cfg.runtime.max_seqs)
    lens = [min(d.prompt_len + 7 * i, cfg.runtime.max_seq_len - d.k - 1) for i in range(n)]
    prompts = []
    for t in lens:
        tokens = torch.randint(0, head.vocab_size, (t + 1,), generator=g)
        hidden = torch.randn(t + 1, head.hidden_size, generator=g).to(dev, head.dtype)
        prompts.append((tokens[:t], hidden[:t], torch.arange(t)))
    for s, prompt in enumerate(prompts):  # warm-up (the kernels' first calls compile), then forget them
        head.prefill(s, *prompt)
    for s in range(n):
        head.free(s)
    t0 = _now(dev)
    for s, prompt in enumerate(prompts):
        head.prefill(s, *prompt)
    prefill_s = _now(dev) - t0
    rows = sum(lens)
    ids = torch.arange(n)
    tokens = torch.randint(0, head.vocab_size, (n,), generator=g)
    hidden = torch.randn(n, head.hidden_size, generator=g).to(dev, head.dtype)
    positions = torch.tensor(lens)
    head.propose(ids, tokens, hidden, positions, d.k)  # warm-up, then rewind
    for s, t in enumerate(lens):
        head.truncate(s, t)
    t0 = _now(dev)
    drafts = head.propose(ids, tokens, hidden, positions, d.k)
    step_s = (_now(dev) - t0) / d.k
    return {"result": "ok", "prefill ms/row": f"{prefill_s * 1e3 / rows:.3f}", "step ms": f"{step_s * 1e3:.3f}",
            "KV blocks": f"{head.cache.blocks_in_use}/{head.cache.spec.num_blocks}",
            "drafts": " ".join(str(x) for x in drafts[0].tolist())}


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _table(rows: list[dict[str, str]]) -> str:
    cols = ["run", "prefill ms/row", "step ms", "KV blocks", "drafts", "result"]
    cells = [[r.get(c, "") for c in cols] for r in rows]
    width = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    line = lambda xs: " | ".join(x.ljust(w) for x, w in zip(xs, width)).rstrip()  # noqa: E731
    return "\n".join([line(cols), "-+-".join("-" * w for w in width)] + [line(x) for x in cells])


def _check_args(args: list[str]) -> None:
    """Refuse before Hydra runs (exit status 2, the usage and the refusal): a missing head, and each value a
    run or a sweep would take (`+head=a,b`, `quant=choice(bf16,fp4)`) that `check_overrides` refuses: an
    unknown head or group option (the options and a "did you mean"), a switch lever set to a non-switch word.
    A sweep with one such value would otherwise end in Hydra's traceback, after the runs before it."""
    if not any(_values(a) for a in args if a.partition("=")[0].lstrip("+~") == "head"):
        print(f"{USAGE}\nno head chosen: add +head=NAME. Heads: {', '.join(list_heads())}", file=sys.stderr)
        raise SystemExit(2)
    refused = []   # every refused value at once, so a sweep of several bad ones is fixed in one round
    for arg in args:
        key = arg.partition("=")[0]
        for value in _values(arg):
            try:
                check_overrides([f"{key}={value}"])
            except ConfigError as e:
                refused.append(str(e))
    if refused:
        print("\n".join([USAGE, *refused]), file=sys.stderr)
        raise SystemExit(2)


def _values(arg: str) -> list[str]:
    """The values an override `key=...` selects, parsed as Hydra parses it (each of a sweep's; a group's glob
    selects only its options that exist); none for a flag, a deletion, an interval sweep, or an override Hydra
    cannot parse (left for Hydra to report)."""
    if arg.startswith("-") or "=" not in arg:
        return []
    try:
        o = OverridesParser.create().parse_overrides([arg])[0]
    except HydraException:
        return []
    if o.is_delete():
        return []
    if o.value_type == ValueType.GLOB_CHOICE_SWEEP:
        group = o.key_or_group
        return o.value().filter(options(group)) if group in GROUPS else []
    if o.is_discrete_sweep():
        return [value_text(v) for v in o.sweep_iterator()]
    if o.is_sweep_override():
        return []
    return [value_text(o.value())]


# Hydra's options that take the next word as their value (unless written --option=value); --info takes one of
# _INFO_WORDS if one follows
_VALUED = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir",
           "--experimental-rerun"}
_INFO_WORDS = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def _options_first(args: list[str]) -> list[str]:
    """Hydra's options (with their values) before the overrides, in their order. Hydra's parser takes the
    overrides as one run of words, so `+head=dense -m quant=bf16,fp8` would end in "unrecognized arguments"."""
    options, overrides = [], []
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("-"):
            overrides.append(word)
        else:
            options.append(word)
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt is not None and (word in _VALUED or word in ("-i", "--info") and nxt in _INFO_WORDS):
                options.append(nxt)
                i += 1
        i += 1
    return options + overrides


def main(argv: list[str] | None = None) -> int:
    args = _options_first(sys.argv[1:] if argv is None else list(argv))
    asks_help = ({"-h", "--help", "--hydra-help", "-i", "-sc"} & set(args)
                 or any(a.startswith(("--info", "--shell-completion")) for a in args))
    if not asks_help:
        _check_args(args)
    registry.load_entry_points()
    sys.argv = [sys.argv[0], *args]
    _rows.clear()
    _swept.clear()
    _swept.update(a.partition("=")[0].lstrip("+~") for a in args if len(set(_values(a))) > 1)
    _run()
    if any("sweep" in r for r in _rows):    # a sweep, even of one run: the table, and exit 0 (refusals are rows)
        print("\n" + _table(_rows))
        return 0
    return 1 if any(r.get("result", "").startswith("refused") for r in _rows) else 0
