"""The CLI, run as a user runs it."""

import os
import subprocess
import sys

import pytest

import mtpfactory
from mtpfactory.cli import _check_args, _check_demo, _demo, _options_first


def cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "mtpfactory", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=180)


@pytest.mark.parametrize("head, ffn", [("dense", "ffn=swiglu, 0 experts"), ("bf16_moe", "ffn=moe, 8 experts")])
def test_run_builds_prefills_and_drafts(head, ffn, tmp_path):
    run = cli(f"+head={head}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert f"MTP head {head}: quant=bf16" in run.stdout and ffn in run.stdout
    assert "step " in run.stdout and "KV blocks in use" in run.stdout
    assert list(tmp_path.iterdir()) == []  # a single run leaves nothing behind


@pytest.mark.parametrize("args, says", [((), "no head chosen"), (("+head=bf16moe",), "did you mean 'bf16_moe'"),
                                        (("-m", "+head=dense,nope"), "head='nope'")])
def test_missing_or_unknown_head_exits_2_listing_heads(args, says, tmp_path):
    run = cli(*args, cwd=tmp_path)
    assert run.returncode == 2
    assert says in run.stderr and "bf16_moe, dense" in run.stderr


def test_multirun_ends_with_a_table_and_refused_rows_do_not_stop_it(tmp_path):
    run = cli("-m", "+head=dense,bf16_moe", "model=qwen3_5_dense_tiny", "runtime.max_seqs=2,3", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    table = run.stdout[run.stdout.index("run "):].splitlines()
    assert len(table) == 2 + 4
    assert sum("refused: model.num_experts" in row for row in table) == 2
    ok = [row for row in table if "+head=dense" in row]
    assert len(ok) == 2 and all("/" in row for row in ok)  # KV blocks in use / pool


def test_a_sweep_flag_after_the_head_runs_the_sweep(tmp_path):
    """`-m` where a user puts it, after the head (Hydra's parser alone takes overrides as one run of words)."""
    run = cli("+head=dense", "-m", "quant=bf16,fp8", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    table = run.stdout[run.stdout.index("run "):].splitlines()
    assert len(table) == 2 + 2 and "quant=bf16" in table[2] and "quant=fp8" in table[3]


@pytest.mark.parametrize("args, hydra_gets", [
    (["+head=dense", "-m", "quant=a,b"], ["-m", "+head=dense", "quant=a,b"]),
    (["+head=dense", "quant=fp8", "--multirun"], ["--multirun", "+head=dense", "quant=fp8"]),
    (["+head=dense", "--cfg", "job", "quant=fp8"], ["--cfg", "job", "+head=dense", "quant=fp8"]),
    (["+head=dense", "-cn=x", "-p", "head", "kv=fp8"], ["-cn=x", "-p", "head", "+head=dense", "kv=fp8"]),
    (["+head=dense", "--info", "defaults", "kv=fp8"], ["--info", "defaults", "+head=dense", "kv=fp8"]),
    (["--info", "+head=dense"], ["--info", "+head=dense"]),         # --info's value is optional
    (["+head=dense", "--cfg"], ["--cfg", "+head=dense"]),           # a missing value is left for Hydra to report
])
def test_hydras_options_go_before_the_overrides(args, hydra_gets):
    assert _options_first(args) == hydra_gets


def test_a_refusal_during_the_demo_is_a_row_and_the_sweep_goes_on(tmp_path):
    # main_kv_blocks=1 caps the pool at one sequence's worth: the demo's third prefill finds it full
    run = cli("-m", "+head=dense", "runtime.max_seq_len=64", "runtime.main_kv_blocks=0,1", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    table = run.stdout[run.stdout.index("run "):].splitlines()
    assert len(table) == 2 + 2
    assert "main_kv_blocks=0" in table[2] and table[2].endswith("| ok")
    assert "main_kv_blocks=1" in table[3] and "refused: kv pool=" in table[3]


def test_a_sweep_of_one_run_is_a_sweep(tmp_path):
    """`-m` with one job still ends with the table, its refusal a row, exit status 0 (not a single run's 1)."""
    run = cli("-m", "+head=bf16_moe", "quant=fp8", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    table = run.stdout[run.stdout.index("run "):].splitlines()
    assert len(table) == 2 + 1 and "quant=fp8" in table[2] and "refused: " in table[2]


def test_a_single_refused_run_says_why_and_exits_1(tmp_path):
    run = cli("+head=dense", "runtime.max_seq_len=4", cwd=tmp_path)
    assert run.returncode == 1
    assert "refused: demo.k=4: needs runtime.max_seq_len >= demo.k + 2" in run.stdout
    assert "Traceback" not in run.stderr + run.stdout


@pytest.mark.parametrize("args, bad", [
    (["+head=choice(dense,bf16_moe)"], None), (["+head=dense,bf16_moe"], None), (["+head=glob(*)"], None),
    (["+head=choice(dense,bf16moe)"], "did you mean 'bf16_moe'"),
    (["+head=dense", "quant=bf16,fp4"], "quant='fp4': unknown; known: bf16, fp8, nvfp4. Fix: did you mean 'nvfp4'?"),
    (["+head=dense", "kv=choice(fp8,fp9)"], "kv='fp9'"),
    (["+head=dense", "quant=glob(*)", "levers.kv_exact=true,off", "runtime.max_seqs=range(1,3)"], None),
    (["+head=dense", "levers.kv_exact=0,2"], "levers.kv_exact='2': a switch: 1, 0, true, false"),
    (["+head=dense", "+levers.drafter_prefill=-1"], "levers.drafter_prefill='-1': a switch"),
    (["+head=dense", "runtime.max_seqs=4,abc"], "runtime.max_seqs='abc': not a value of the field's type, int. "
                                                "Fix: give runtime.max_seqs a value of type int, e.g. its default 8"),
    (["+head=dense", "quant.lm_head=null"], "give quant.lm_head a value of type str, e.g. its default 'auto'"),
    # every refused value named at once, not the first only
    (["+head=bf16_moe,per_expert_moe,nvfp4_moe"], "head='per_expert_moe': not built yet (DESIGN 2.2 plans it); "
                                                  "built: bf16_moe, dense. Fix: choose one of bf16_moe, dense\n"
                                                  "head='nvfp4_moe': not built yet"),
    (["+head=dense,dens3,denze"], "head='dens3': unknown; known: bf16_moe, dense. Fix: did you mean 'dense'?\n"
                                  "head='denze': unknown"),
    (["+head=dense", "quant=fp4", "kv=fp9"], "quant='fp4': unknown; known: bf16, fp8, nvfp4. Fix: did you mean "
                                             "'nvfp4'?\nkv='fp9'"),
    (["+head=dense", "model.num_experts=null", "weights.path=null", "model.rope_theta=1e7,1e6"], None),
    # a key the schema lacks, without +: Hydra's own message, no "did you mean", a sweep aborted
    (["+head=dense", "quant=bf16,fp8", "levers.kv_exct=true"], "levers.kv_exct='True': not a config key"),
    (["+head=dense", "quantt=fp8"], "quantt='fp8': not a config key; known here: head, model"),
    (["+head=dense", "model._target_=os.system"], "never by _target_"),
    (["+head=dense", "hydra.run.dir=/tmp/x", "hydra.job.chdir=false"], None),
    # a value as the field will hold it, not as Hydra escapes it to write it back (`$\{runtime.max_seqs\}`)
    (["+head=dense", "runtime.prefill_chunk=${runtime.max_seqs}", "runtime.max_seqs=${demo.k},8"], None),
    (["+head=dense", "runtime.max_seqs='abc'"], "runtime.max_seqs='abc': not a value of the field's type, int"),
    # a head without `+`: Hydra's "Could not override 'head'" and exit 1, not the usage
    (["head=dense,bf16_moe"], "head='dense': a head is added to the config, written +head=NAME. Fix: write "
                              "+head=dense"),
    # a section set whole: each key checked (was Hydra's own error, which stopped a sweep without its table)
    (["+head=dense", "demo={k:5,_target_:os.system}"], "demo._target_='os.system'"),
])
def test_every_sweep_value_of_a_group_or_switch_is_checked_before_hydra_runs(args, bad, capsys):
    """A head, a group option, a switch's word or a value of the wrong type that no run could take refuses the
    command at once (exit status 2, the usage and the refusal), not Hydra's traceback after the runs before
    it."""
    if bad is None:
        _check_args(["-m", *args])
        return
    with pytest.raises(SystemExit) as e:
        _check_args(["-m", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and bad in err and err.startswith("usage: ")


def test_a_key_the_schema_lacks_is_a_refused_row_naming_it(tmp_path):
    """`+key=value` is added as written by Hydra: a typo, or a `_target_`, is refused (a row in a sweep), not run
    as if absent."""
    run = cli("-m", "+head=dense", "+levers.kv_exct=true,false", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    table = run.stdout[run.stdout.index("run "):].splitlines()
    assert len(table) == 2 + 2 and all("refused: levers.kv_exct=" in row and "levers.kv_exact?" in row
                                       for row in table[2:])
    run = cli("+head=dense", "+head._target_=os.system", cwd=tmp_path)
    assert run.returncode == 1 and "refused: head._target_='os.system': not a config key" in run.stdout


def test_a_head_sweep_takes_an_override_of_the_heads_fields(tmp_path):
    """`head.ffn=...` beside a head sweep: the head node exists before the sweep chooses one (it was None, and
    Hydra failed on it with a traceback before any run)."""
    run = cli("-m", "+head=dense,bf16_moe", "head.norm=rmsnorm", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    table = run.stdout[run.stdout.index("run "):].splitlines()
    assert len(table) == 2 + 2 and "Traceback" not in run.stderr


def test_the_demo_times_its_prefill_after_a_warm_up_of_the_same_calls(monkeypatch):
    """The first calls compile (the Triton kernels) and would be timed as prefill: each prompt is prefilled once,
    freed, then prefilled again under the clock; the KV blocks in use are one prefill's."""
    cfg = mtpfactory.compose("+head=dense", "runtime.device=cpu", "demo.sequences=2")
    head = mtpfactory.build_head(cfg)
    calls = []
    for name in ("prefill", "free"):
        method = getattr(head, name)
        monkeypatch.setattr(head, name, lambda s, *a, _m=method, _n=name: (calls.append((_n, s)), _m(s, *a))[1])
    row = _demo(cfg, head)
    assert calls == [("prefill", 0), ("prefill", 1), ("free", 0), ("free", 1), ("prefill", 0), ("prefill", 1)]
    # prompts of 40 and 47 rows, 4 drafts each, blocks of 16: 3 + 4 blocks
    assert row["KV blocks"].startswith(f"{head.cache.blocks_in_use}/") and head.cache.blocks_in_use == 3 + 4


def test_a_malformed_lever_variable_refuses_the_run_naming_it(tmp_path):
    """`MTPF_KV_EXACT=2` would read as a bool (switched on): the run is refused naming the variable, exit 1."""
    env = dict(os.environ, MTPF_KV_EXACT="2")
    run = subprocess.run([sys.executable, "-m", "mtpfactory", "+head=dense"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 1 and "refused: MTPF_KV_EXACT='2': levers.kv_exact is a switch" in run.stdout
    assert "Traceback" not in run.stderr + run.stdout


def test_the_demo_cuts_its_prompts_so_the_drafts_fit_max_seq_len():
    """The smallest max_seq_len the demo takes (demo.k + 2): prompts of one row, then k drafts at positions
    1..k, all below max_seq_len."""
    cfg = mtpfactory.compose("+head=dense", "runtime.device=cpu", "runtime.max_seq_len=6", "demo.sequences=2")
    _check_demo(cfg)
    head = mtpfactory.build_head(cfg)
    row = _demo(cfg, head)
    assert row["result"] == "ok" and len(row["drafts"].split()) == 4
    assert all((s.start, s.end) == (0, 5) for s in head.cache.seqs.values())


def test_a_sweep_over_the_weights_sources_gives_its_path_to_the_checkpoint_runs(tmp_path):
    """`-m weights=synthetic,checkpoint weights.path=DIR`: the path is the checkpoint runs'; the synthetic run
    leaves it unread, where a run of synthetic weights alone refuses a path (it would go unread: a user who
    meant the checkpoint forgot weights=checkpoint), as does a sweep that does not vary the weights."""
    from safetensors.torch import save_file
    from mtpfactory.weights.synthetic import qwen_mtp_weights
    cfg = mtpfactory.compose("+head=dense")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({n: t.contiguous() for n, t in qwen_mtp_weights(cfg.model, "dense", seed=3).items()},
              ckpt / "model.safetensors")
    run = cli("-m", "+head=dense", "weights=synthetic,checkpoint", f"weights.path={ckpt}", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    table = run.stdout[run.stdout.index("run "):].splitlines()
    assert len(table) == 2 + 2 and all(row.endswith("| ok") for row in table[2:]), table
    run = cli("-m", "+head=dense", "quant=bf16,fp8", f"weights.path={ckpt}", cwd=tmp_path)
    table = run.stdout[run.stdout.index("run "):].splitlines()
    assert all("refused: weights.path=" in row for row in table[2:]) and len(table) == 2 + 2
