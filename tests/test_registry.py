"""The component registry: lazy built-ins, did-you-mean, taken names, re-import, a user's own FFN chosen
from Python, from the config and from the CLI (through an entry point)."""

import contextlib
import importlib
import importlib.metadata
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import mtpfactory
from mtpfactory import ops, registry
from mtpfactory.components.ffn import SwiGLU, build_swiglu
from mtpfactory.components.norms import RMSNorm
from mtpfactory.errors import ConfigError, UnknownNameError

ACCEPTS = lambda *args, **kwargs: None  # noqa: E731  (an op contract that refuses nothing)


class HalfSwiGLU(torch.nn.Module):
    """A user's FFN: the dense SwiGLU's output halved (so its effect on the logits is visible)."""

    def __init__(self, inner: SwiGLU) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        return 0.5 * self.inner(x)


def build_half_swiglu(ctx, prefix):
    return HalfSwiGLU(build_swiglu(ctx, prefix))


def test_builtins_are_listed_and_lazily_found():
    assert {"swiglu", "moe"} <= set(registry.names("ffn"))
    assert registry.get("ffn", "swiglu") is build_swiglu
    assert mtpfactory.list_heads() == ["bf16_moe", "dense"]


def test_unknown_name_says_did_you_mean():
    with pytest.raises(UnknownNameError, match="did you mean 'swiglu'") as e:
        registry.get("ffn", "swiglo")
    assert e.value.field == "head.ffn" and isinstance(e.value, ValueError)
    with pytest.raises(UnknownNameError, match="component kind"):
        registry.get("mlp", "swiglu")


def test_a_taken_name_is_refused_unless_override():
    with pytest.raises(ConfigError, match="taken"):
        registry.register("ffn", "swiglu", build_half_swiglu)
    registry.register("ffn", "test_half_swiglu", build_half_swiglu)
    registry.register("ffn", "test_half_swiglu", build_half_swiglu)  # the same builder again: fine
    with pytest.raises(ConfigError, match="override=True"):
        registry.register("ffn", "test_half_swiglu", lambda ctx, prefix: None)
    replacement = registry.register("ffn", "test_half_swiglu", lambda ctx, prefix: None, override=True)
    assert registry.get("ffn", "test_half_swiglu") is replacement
    registry.register("ffn", "test_half_swiglu", build_half_swiglu, override=True)


@contextlib.contextmanager
def reloaded(name: str):
    """Module `name` reloaded, then its namespace put back as it was: the functions and classes a reload makes
    would stay in the module, and later tests' isinstance checks against the classes they imported would fail."""
    mod = importlib.import_module(name)
    saved = dict(mod.__dict__)
    try:
        yield importlib.reload(mod)
    finally:
        mod.__dict__.clear()
        mod.__dict__.update(saved)


def test_reimporting_a_module_that_registers_does_not_break(empty_registry, monkeypatch):
    monkeypatch.setattr(ops, "_OPS", dict(ops._OPS))        # the reloaded ops register again: into a copy
    importlib.import_module("mtpfactory.heads.qwen_mtp")   # the heads import the built-ins before the reload
    with reloaded("mtpfactory.components.ffn") as mod:
        registry.register("ffn", "swiglu", mod.build_swiglu)  # same qualified name as the built-in: allowed
        with reloaded("mtpfactory.kernels.rms_norm"):
            # the heads tell the reloaded built-ins by what they are (it ran on to a TypeError, comparing identities)
            cfg = mtpfactory.compose("+head=dense", "runtime.device=cpu", "head.ffn=moe")
            with pytest.raises(ConfigError, match="^head.ffn='moe': builds a moe FFN; head dense has a dense FFN"):
                mtpfactory.build_head(cfg)


def test_user_ffn_chosen_from_python_and_config_changes_the_head():
    mtpfactory.register("ffn", "test_half_swiglu", build_half_swiglu, override=True)
    base = ("+head=dense", "runtime.dtype=float32", "runtime.device=cpu")
    plain = mtpfactory.build_head(mtpfactory.compose(*base))
    mine = mtpfactory.build_head(mtpfactory.compose(*base, "head.ffn=test_half_swiglu"))
    assert isinstance(mine.ffn, HalfSwiGLU)
    g = torch.Generator().manual_seed(0)
    tokens, hidden = torch.randint(0, 512, (5,), generator=g), torch.randn(5, 64, generator=g)
    outs = []
    for head in (plain, mine):
        head.prefill(0, tokens[:4], hidden[:4], torch.arange(4))
        outs.append(head.step(torch.tensor([0]), tokens[4:], hidden[4:], torch.tensor([4]))[1])
    assert mine.ffn.calls == 1  # the prefill path writes KV only; the step ran the user's FFN
    assert not torch.allclose(outs[0], outs[1])


class CountingNorm(RMSNorm):
    """A user's norm: the built-in RMSNorm's math under another class, counting its calls."""

    calls = 0

    def forward(self, x, residual=None):
        CountingNorm.calls += 1
        return super().forward(x, residual)


def build_counting_norm(ctx, name, dim, eps):
    return CountingNorm(ctx.tensor(name, dim), eps, zero_centred=True)


@pytest.mark.parametrize("lm_head", ["bf16", "nvfp4"])
def test_user_norm_runs_itself_where_the_builtin_norms_fuse(lm_head):
    """The heads fuse the built-in RMSNorm into its neighbours (`embed_norm_cat`, `rms_norm_rope`, an NVFP4 LM
    head's `rms_norm_linear_nvfp4`); a norm of the user's own is called, each of the seven once a step (q, k, the
    two fc-input norms, the input and post-attention layernorms, the final norm), and gives the built-in's answer
    where its math is the same: relative 1e-5 in fp32 through the Triton path (the fused kernels sum each row in
    another order)."""
    mtpfactory.register("norm", "test_counting_norm", build_counting_norm, override=True)
    base = ("+head=bf16_moe", f"quant.lm_head={lm_head}", "runtime.dtype=float32", "runtime.device=cpu",
            "runtime.backend=triton", "runtime.prefill_chunk=32")
    g = torch.Generator().manual_seed(1)
    tokens, hidden = torch.randint(0, 512, (5,), generator=g), torch.randn(5, 64, generator=g)
    outs = []
    for norm in ("zero_centred_rmsnorm", "test_counting_norm"):
        head = mtpfactory.build_head(mtpfactory.compose(*base, f"head.norm={norm}"))
        head.prefill(0, tokens[:4], hidden[:4], torch.arange(4))
        CountingNorm.calls = 0
        outs.append(head.step(torch.tensor([0]), tokens[4:], hidden[4:], torch.tensor([4])))
    assert CountingNorm.calls == 7, CountingNorm.calls
    for got, want in zip(outs[1], outs[0]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_user_ffn_from_the_cli_through_an_entry_point(tmp_path):
    (tmp_path / "half_ffn.py").write_text(textwrap.dedent("""
        import mtpfactory
        from mtpfactory.components.ffn import build_swiglu

        def build(ctx, prefix):
            inner = build_swiglu(ctx, prefix)
            print("half_ffn built")
            return lambda x: 0.5 * inner(x)

        mtpfactory.register("ffn", "half_ffn", build)
    """))
    dist = tmp_path / "half_ffn-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: half-ffn\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[mtpfactory.components]\nhalf_ffn = half_ffn\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    run = subprocess.run([sys.executable, "-m", "mtpfactory", "+head=dense", "head.ffn=half_ffn", "demo.k=2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "half_ffn built" in run.stdout and "ffn=half_ffn" in run.stdout


def test_an_op_provider_name_taken_by_another_function_is_refused(monkeypatch):
    monkeypatch.setattr(ops, "_OPS", {})  # a throwaway op, out of the real registry

    def make(k):
        def provider(x):
            return x * k
        return provider

    op = ops.Op("test_op", lambda x: x, ACCEPTS)
    # Two lambdas; two closures from one factory: each pair shares a qualified name, not a function.
    lambdas = (lambda x: x + 1,
               lambda x: x + 2)
    for name, first, other in (("lambda", *lambdas), ("closure", make(2), make(3))):
        op.register_provider(name, first, lambda x: None)
        op.register_provider(name, first, lambda x: None)  # the same function again: fine
        with pytest.raises(ConfigError, match="already registered"):
            op.register_provider(name, other, lambda x: None)
        assert op.providers[name].fn is first

    # One `def` run twice, as a module re-import runs it: a new object from the same place, which replaces it.
    code = compile("def provider(x):\n    return -x\n", "user_provider.py", "exec")
    runs = [{"__name__": "user_provider"}, {"__name__": "user_provider"}]
    for namespace in runs:
        exec(code, namespace)
        op.register_provider("user", namespace["provider"], lambda x: None)
    assert op.providers["user"].fn is runs[1]["provider"]


@pytest.fixture
def empty_registry(monkeypatch, tmp_path):
    """No user registrations, entry points not loaded yet, and tmp_path importable; restored afterwards."""
    monkeypatch.setattr(registry, "_registered", {k: {} for k in registry.KINDS})
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    monkeypatch.syspath_prepend(tmp_path)
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("mtpf_test_"):
            del sys.modules[name]


def test_a_different_builder_under_a_taken_name_is_refused_even_with_the_same_qualname(empty_registry, monkeypatch):
    registry.register("ffn", "mine", lambda ctx, prefix: "a")
    with pytest.raises(ConfigError, match="taken"):
        registry.register("ffn", "mine", lambda ctx, prefix: "b")

    def scaled(s):
        return lambda ctx, prefix: s

    registry.register("ffn", "scaled", scaled(1))
    with pytest.raises(ConfigError, match="taken"):  # one factory's closures share their code, not their capture
        registry.register("ffn", "scaled", scaled(2))
    assert registry.get("ffn", "scaled")(None, "") == 1

    a, b = lambda ctx, prefix: "a", lambda ctx, prefix: "b"  # noqa: E731  (one line: same name, file and line)
    registry.register("ffn", "one_line", a)
    with pytest.raises(ConfigError, match="taken"):
        registry.register("ffn", "one_line", b)
    assert registry.get("ffn", "one_line") is a
    monkeypatch.setattr(ops, "_OPS", {})  # a throwaway op, out of the real registry
    op = ops.Op("test_op", lambda x: x, ACCEPTS)
    op.register_provider("triton", a, lambda x: None)
    with pytest.raises(ConfigError, match="already registered"):
        op.register_provider("triton", b, lambda x: None)


def test_a_reimported_plugin_module_registers_again(empty_registry):
    (empty_registry / "mtpf_test_plugin.py").write_text(textwrap.dedent("""
        import mtpfactory

        def build(ctx, prefix):
            return None

        class FFN:
            pass

        mtpfactory.register("ffn", "plugin_fn", build)
        mtpfactory.register("ffn", "plugin_cls", FFN)
    """))
    mod = importlib.import_module("mtpf_test_plugin")
    first = registry.get("ffn", "plugin_fn")
    importlib.reload(mod)
    assert registry.get("ffn", "plugin_fn") is mod.build is not first
    assert registry.get("ffn", "plugin_cls") is mod.FFN


def test_a_failing_entry_point_is_named_and_the_others_still_load(empty_registry, monkeypatch, caplog):
    (empty_registry / "mtpf_test_broken.py").write_text("raise ImportError('needs a package that is not here')\n")
    (empty_registry / "mtpf_test_good.py").write_text(textwrap.dedent("""
        import mtpfactory

        mtpfactory.register("ffn", "good", lambda ctx, prefix: None)
    """))
    eps = [importlib.metadata.EntryPoint(name, value, registry.ENTRY_POINT_GROUP)
           for name, value in (("broken", "mtpf_test_broken"), ("good", "mtpf_test_good"))]
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    with caplog.at_level("ERROR", logger="mtpfactory.registry"):
        assert "good" in registry.names("ffn")
    assert "entry point broken = mtpf_test_broken" in caplog.text
    assert "needs a package that is not here" in caplog.text


def test_a_refused_op_call_names_its_keyword_tensors_too(monkeypatch):
    """`runtime.backend=triton` with no provider for the call: the error lists every tensor, `out=` included."""
    monkeypatch.setattr(ops, "_OPS", {})
    op = ops.Op("test_op", lambda x, *, out=None: x, ACCEPTS)
    with ops.use_backend("triton"), pytest.raises(ConfigError, match=r"\(2, 3\) float32 cpu, out=\(2, 3\) int64 cpu"):
        op(torch.zeros(2, 3), out=torch.zeros(2, 3, dtype=torch.int64))


def test_an_explicit_backend_that_cannot_serve_a_call_says_why(monkeypatch):
    """`runtime.backend=triton` on a call its provider refuses: the error words the provider's refusal, or, where
    the refusal finds nothing, names the device check (`can_run`) that said no and the tensors' devices. `auto`
    gives both calls to the reference."""
    from mtpfactory.errors import InputError
    monkeypatch.setattr(ops, "_OPS", {})
    op = ops.Op("test_op_why", lambda x: -x, ACCEPTS)
    def refusal(x):
        return None if x.dim() == 2 else InputError("x", f"{x.dim()}-D", "a 2-D tensor", "(a test)")

    op.register_provider("triton", lambda x: x, refusal, can_run=lambda *ts: True)
    assert op.providers["triton"].supports(torch.zeros(2, 3)) and not op.providers["triton"].supports(torch.zeros(3))
    with ops.use_backend("triton"), pytest.raises(ConfigError, match=r"it refuses x='1-D': a 2-D tensor\)"):
        op(torch.zeros(3))

    def nowhere(*tensors):
        return False

    elsewhere = ops.Op("test_op_elsewhere", lambda x, *, out=None: -x, ACCEPTS)
    elsewhere.register_provider("triton", lambda x, *, out=None: x, lambda x, *, out=None: None, can_run=nowhere)
    with ops.use_backend("triton"), pytest.raises(ConfigError, match=r"nowhere refuses tensors on cpu\)"):
        elsewhere(torch.zeros(3), out=torch.zeros(3))
    with ops.use_backend("auto"):
        assert op(torch.ones(3)).eq(-1).all() and elsewhere(torch.ones(3)).eq(-1).all()


def test_a_provider_takes_a_call_only_where_it_can_run_on_every_tensor_the_call_holds(monkeypatch):
    """The device check sees every tensor of a call: positional, keyword, and inside tuple or list arguments
    (an `out=` triple)."""
    monkeypatch.setattr(ops, "_OPS", {})
    seen = []
    op = ops.Op("test_op_tensors", lambda *a, **k: None, ACCEPTS)
    op.register_provider("triton", lambda *a, **k: None, lambda *a, **k: None,
                         can_run=lambda *ts: seen.append(len(ts)) or True)
    a, b, c, d = (torch.zeros(1) for _ in range(4))
    assert op.providers["triton"].supports(a, 2.0, "name", out=(b, c), extra=[d], none=None)
    assert seen == [4]


def test_a_kernel_this_gpu_cannot_launch_falls_back_under_auto_and_is_refused_under_triton(monkeypatch, caplog):
    """Triton's OutOfResources (a kernel needing more shared memory than the GPU has, raised while loading it,
    before its launch) is no predicate's business: `auto` runs the reference, warning once a kind of call;
    `triton` refuses, naming the op and the resource. Any other error of the provider is its own."""
    from triton.runtime.errors import OutOfResources
    monkeypatch.setattr(ops, "_OPS", {})
    monkeypatch.setattr(ops, "_warned", set())
    raised = []

    def provider(x):
        raised.append(1)
        raise OutOfResources(300000, 232448, "shared memory")

    op = ops.Op("test_op_oor", lambda x: x * 2, ACCEPTS)
    op.register_provider("triton", provider, lambda x: None, can_run=lambda *ts: True)
    x = torch.ones(3)
    with ops.use_backend("auto"), caplog.at_level("WARNING", logger="mtpfactory.ops"):
        assert op(x).eq(2).all() and op(x).eq(2).all()
    assert len(raised) == 2
    warned = [r.getMessage() for r in caplog.records if "test_op_oor" in r.getMessage()]
    assert len(warned) == 1 and "shared memory" in warned[0] and "running the reference" in warned[0]
    with ops.use_backend("triton"), pytest.raises(ConfigError, match=r"test_op_oor's triton provider cannot launch "
                                                                     r"this call on this GPU .*shared memory"):
        op(x)

    def broken(x):
        raise RuntimeError("a bug, not a resource limit")

    other = ops.Op("test_op_bug", lambda x: x, ACCEPTS)
    other.register_provider("triton", broken, lambda x: None, can_run=lambda *ts: True)
    with ops.use_backend("auto"), pytest.raises(RuntimeError, match="a bug"):
        other(x)


def test_a_predicate_registered_as_a_refusal_is_named_not_silently_never_chosen(monkeypatch):
    """register_provider's third argument is a refusal (an error or None): a predicate there (True or False)
    would make the provider never serve, so the first call says so."""
    monkeypatch.setattr(ops, "_OPS", {})
    op = ops.Op("test_op_predicate", lambda x: x, ACCEPTS)
    op.register_provider("triton", lambda x: x, lambda x: True, can_run=lambda *ts: True)
    with ops.use_backend("auto"), pytest.raises(TypeError, match="its refusal returned True.*not a predicate"):
        op(torch.zeros(2))


def test_entry_points_load_once_at_the_first_lookup_of_a_name_no_builtin_holds(empty_registry, monkeypatch):
    """`registry.get` finds a plugin's component without the CLI (serving code composes and builds); the entry
    points load once, not again at every lookup (a callable entry point re-run, a broken one logged again)."""
    (empty_registry / "mtpf_test_counted.py").write_text(textwrap.dedent("""
        import mtpfactory

        calls = []

        def load():
            calls.append(1)
            mtpfactory.register("ffn", "counted", lambda ctx, prefix: None)
    """))
    eps = [importlib.metadata.EntryPoint("counted", "mtpf_test_counted:load", registry.ENTRY_POINT_GROUP)]
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: eps if group == registry.ENTRY_POINT_GROUP else [])
    registry.get("ffn", "swiglu")
    assert "mtpf_test_counted" not in sys.modules      # a built-in's lookup loads no plugin
    assert registry.get("ffn", "counted") is not None
    assert "counted" in registry.names("ffn") and "counted" in registry.names("ffn")
    with pytest.raises(UnknownNameError):
        registry.get("ffn", "uncounted")
    assert sys.modules["mtpf_test_counted"].calls == [1]


def test_the_same_code_with_other_defaults_or_a_local_class_of_one_factory_is_another_builder(empty_registry):
    """Only a module re-import makes the same builder again: a `def` of equal code with other defaults (a loop's
    `k=k`), or a class defined inside a factory, is a second builder under the taken name."""
    for k in (1, 2):
        def scaled(ctx, prefix, k=k):
            return k
        if k == 1:
            registry.register("ffn", "scaled", scaled)
            registry.register("ffn", "scaled", scaled)      # the same function again: fine
        else:
            with pytest.raises(ConfigError, match="taken"):
                registry.register("ffn", "scaled", scaled)
    assert registry.get("ffn", "scaled")(None, "") == 1

    def factory():
        class Local:
            pass
        return Local

    first, second = factory(), factory()
    assert registry.same_definition(first, first) and not registry.same_definition(first, second)
    registry.register("ffn", "local", first)
    with pytest.raises(ConfigError, match="taken"):
        registry.register("ffn", "local", second)


@pytest.mark.parametrize("backend", ["native", "triton"])
def test_a_head_is_built_under_its_configured_backend(empty_registry, backend):
    """Build-time quantization runs the same ops as the forward: under `runtime.backend`, not `auto` (an explicit
    `triton` that cannot serve an op must refuse at build too)."""
    seen = []

    def probe(ctx, prefix):
        seen.append(ops._backend.get())
        return build_swiglu(ctx, prefix)

    registry.register("ffn", "backend_probe", probe)
    cfg = mtpfactory.compose("+head=dense", "runtime.dtype=float32", "runtime.device=cpu",
                             f"runtime.backend={backend}", "runtime.max_seqs=4", "runtime.prefill_chunk=32",
                             "head.ffn=backend_probe")
    mtpfactory.build_head(cfg)
    assert seen == [backend] and ops._backend.get() == "auto"
