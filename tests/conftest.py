"""Shared test set-up: CPU float32, small random Hugging Face models as parity oracles."""

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch (the transformers oracles) on one OpenMP thread: with every core busy (a worker per
# core, see below) its threads wait ~15 ms for each other at every parallel product; a 37-token
# SmolLM2 forward took 4.1 s on two threads against 0.23 s on one (BENCHMARKS.md, CI time).
# Set before torch is imported; subprocesses the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if os.environ["JAX_PLATFORMS"] != "cpu":
    # On a GPU float32 dots default to TF32, whose rounding the float32 noise units of
    # tolerances.py do not allow for: the oracles and references run at full precision.
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# The suite writes neither to the user's persistent compilation cache nor to its remembered
# `auto` choices; the caches' own tests turn them on with a temporary folder.
os.environ.setdefault("EAGLEJAX_COMPILATION_CACHE", "0")
os.environ.setdefault("EAGLEJAX_AUTOTUNE_CACHE", "0")
# The suite compiles thousands of programs that each run for milliseconds: LLVM's optimising
# passes were ~20% of its CPU time (BENCHMARKS.md, CI time). Code generated without them
# computes the same operations (tolerances are noise units, see tolerances.py); a level the
# caller's XLA_FLAGS names is kept. Subprocesses the tests start inherit it.
# XLA:CPU's newer fusion emitters (one MLIR-lowered LLVM module per fusion) took about twice
# the legacy emitters' compile time for the decode loops: a paged engine test's compiles 13.4
# -> 6.9 s, the test 17.8 -> 11.1 s; SmolLM2's forwards ran no slower (BENCHMARKS.md, CI
# time, session 42). XLA aborts on a flag it does not know, so this one is set only where
# the installed jaxlib names it. A choice the caller's XLA_FLAGS makes is kept.


def _jaxlib_knows(flag: str) -> bool:
    import importlib.util
    import mmap

    spec = importlib.util.find_spec("jaxlib")
    library = Path(spec.origin).parent / "libjax_common.so" if spec and spec.origin else None
    if library is None or not library.is_file():
        return False
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        return m.find(flag.encode()) >= 0


for flag, value in (("xla_backend_optimization_level", "0"),
                    ("xla_cpu_use_fusion_emitters", "false")):
    if os.environ["JAX_PLATFORMS"] == "cpu" and flag not in os.environ.get("XLA_FLAGS", "") and (
            flag == "xla_backend_optimization_level" or _jaxlib_knows(flag)):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --{flag}={value}").strip()

import pytest  # noqa: E402

from hf_oracle import make_hf_model  # noqa: E402

def share_native_builds(root):
    """`root` (a Path) made an eaglejax cache folder whose native kernel builds are this
    run's (a link to them): a process given it as $EAGLEJAX_CACHE loads the kernels instead
    of building all of them again (~30 s of CPU on 2 cores, each time). Returns `root`."""
    from eaglejax.compilation_cache import cache_root

    built = cache_root() / "native"
    built.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "native").exists():
        (root / "native").symlink_to(built, target_is_directory=True)
    return root


MEMORY_PER_WORKER = 6 * 2**30  # a worker's peak: SmolLM2, its transformers oracle, programs


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, as many as the memory holds."""
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cores or 1, psutil.virtual_memory().total // MEMORY_PER_WORKER))


def pytest_collection_modifyitems(config, items):
    """Files holding `slow` tests (real models, 8-device and two-process runs) first: the
    workers take whole files in this order, so the long ones start early and no worker idles
    at the end while another runs one of them alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.fixture(scope="session")
def hf_family(tmp_path_factory):
    """family -> (saved directory, transformers model); each built once per session."""
    built = {}

    def get(family: str):
        if family not in built:
            directory = tmp_path_factory.mktemp(family)
            built[family] = (directory, make_hf_model(family, directory))
        return built[family]

    return get


@pytest.fixture(scope="session")
def target_of(hf_family):
    """family -> eaglejax Target loaded from the saved Hugging Face directory."""
    import eaglejax

    loaded = {}

    def get(family: str):
        if family not in loaded:
            loaded[family] = eaglejax.load_target(hf_family(family)[0])
        return loaded[family]

    return get


@pytest.fixture(scope="session")
def smollm_path():
    """The default model's GGUF; fails with the install command when its package is
    missing (never skipped)."""
    from eaglejax.loading.builtin import resolve_builtin

    return resolve_builtin("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2():
    """The default real model, loaded by eaglejax from its GGUF."""
    import eaglejax

    return eaglejax.load_target("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm2_hf():
    """transformers' oracle for the same GGUF: its own dequantizer and un-permutation
    feeding its own dense float32 LlamaForCausalLM."""
    from eaglejax.loading.builtin import resolve_builtin
    from hf_oracle import transformers_model_from_gguf

    return transformers_model_from_gguf(resolve_builtin("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def selfdraft_target(tmp_path_factory):
    """A random transformers Llama edited so a head made of its own layers drafts well."""
    import eaglejax
    from spec_helpers import make_selfdraftable

    directory = tmp_path_factory.mktemp("selfdraft")
    model = make_hf_model("llama", directory, seed=11, num_hidden_layers=2)
    make_selfdraftable(model)
    model.save_pretrained(directory)
    return eaglejax.load_target(directory)


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drop every compiled program after each test module. The suite compiles hundreds of
    loops; XLA:CPU keeps each executable's code mapped, and late in a single-process run
    a compile segfaulted (jax 0.10.2) once the process held that many."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture
def fresh_layer_traces():
    """For a test that patches what a decoder layer reads while it is traced: the layer's
    traces (kept across jits by `llama.decoder_layer_call`) are dropped before and after."""
    from eaglejax.models import llama

    llama.decoder_layer_call.clear_cache()
    yield
    llama.decoder_layer_call.clear_cache()


_LOWERINGS: list[list[str]] = []  # the lists of the `lowered_programs` fixtures in use


def _record_lowering(event: str, seconds: float, **kwargs) -> None:
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
        for names in _LOWERINGS:
            names.append(str(kwargs.get("fun_name", "?")))


@pytest.fixture
def lowered_programs():
    """A list that collects the name of every program JAX lowers for compiling while the test
    runs (a compile, whether or not a persistent cache then holds its executable)."""
    import jax.monitoring

    if not getattr(_record_lowering, "registered", False):
        jax.monitoring.register_event_duration_secs_listener(_record_lowering)
        _record_lowering.registered = True
    names: list[str] = []
    _LOWERINGS.append(names)
    yield names
    _LOWERINGS.remove(names)
