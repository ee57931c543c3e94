"""Shared fixtures. Helpers append their own fixtures below; keep each block self-contained."""
from __future__ import annotations

import os

import pytest

# `make test` runs the suite on one pytest-xdist worker per core: a worker's torch, BLAS and the CLI
# processes it starts then keep to one thread each, or their thread pools would contend for the same
# cores. Set before the tests import torch or numpy.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_name, "1")

from simulator import BlockManager, ContiguousAllocator, Sequence, SequenceGroup  # noqa: E402


@pytest.fixture
def make_group():
    """Factory for single- or multi-sequence groups with fresh ids."""
    counter = iter(range(10**9))

    def make(prompt_len: int, final_len: int | None = None, *, n: int = 1, token_ids=None,
             prefix_keys=(), request_id: int | None = None) -> SequenceGroup:
        rid = next(counter) if request_id is None else request_id
        seqs = [Sequence(next(counter), prompt_len, final_len, request_id=rid,
                         token_ids=None if token_ids is None else list(token_ids), prefix_keys=prefix_keys)
                for _ in range(n)]
        return SequenceGroup(rid, seqs, n=n)

    return make


@pytest.fixture
def paged():
    """A debug-checked paged allocator factory."""
    def make(num_blocks: int = 16, block_size: int = 4, **kw) -> BlockManager:
        kw.setdefault("debug", True)
        return BlockManager(num_blocks, block_size, **kw)
    return make


@pytest.fixture
def contiguous():
    """A debug-checked contiguous allocator factory."""
    def make(capacity: int = 64, policy: str = "max", placement: str = "buddy", **kw) -> ContiguousAllocator:
        kw.setdefault("debug", True)
        return ContiguousAllocator(capacity, policy, placement, **kw)
    return make


# --- gpu_backend model: small random-weight Hugging Face checkpoints (fp32, safetensors) -------------------
# Shapes are tiny so the whole parity suite runs in seconds on a 2-core CPU; GQA (4 query heads, 2 KV heads)
# and 3 layers are the smallest that still exercise head grouping and layer-to-layer cache indexing.
HF_TINY_SHAPE = dict(vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
HF_TINY_VARIANTS = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    # original_max_position_embeddings is small so that test positions (up to ~80) reach every branch
    # of the llama3 frequency ramp.
    "llama3-rope": ("LlamaForCausalLM", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "linear-rope": ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # A window longer than any test sequence: sliding-window attention then equals full attention.
    "mistral": ("MistralForCausalLM", {"sliding_window": 256}),
}


@pytest.fixture(scope="session")
def hf_model_dirs(tmp_path_factory) -> dict:
    """name -> directory of a random-weight transformers checkpoint (see HF_TINY_VARIANTS).

    Every parameter is redrawn (norm weights near 1, biases nonzero, matrices with std 1/sqrt(fan_in)) so
    that loading a wrong tensor, dropping a bias or a norm weight changes the logits visibly.
    """
    transformers = pytest.importorskip("transformers")
    import torch

    dirs = {}
    for seed, (name, (arch, extra)) in enumerate(HF_TINY_VARIANTS.items()):
        family = arch.removesuffix("ForCausalLM")
        config = getattr(transformers, f"{family}Config")(**HF_TINY_SHAPE, **extra)
        model = getattr(transformers, arch)(config)
        gen = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=gen)
                if "norm" in pname:
                    param.copy_(1.0 + 0.1 * noise)
                elif param.dim() == 1:
                    param.copy_(0.1 * noise)
                else:
                    param.copy_(noise / param.shape[1] ** 0.5)
        path = tmp_path_factory.mktemp(f"hf-{name}")
        model.save_pretrained(path, safe_serialization=True)
        dirs[name] = path
    return dirs


# --- gpu_backend engine: one torch thread for tiny models -----------------------------------------------
@pytest.fixture(scope="module")
def single_thread():
    """Run a module's tiny-model forwards on one torch thread (restored afterwards).

    Their matmuls are too small to gain from threads, and on a shared 2-core machine the spinning OpenMP
    threads of concurrent processes make every op wait for a time slice (30-50x slower).
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- a small real file system to fill: a tmpfs, where this process may mount one -------------------------
@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs of `size` (mount's size= syntax, e.g. "256k") at tmp_path/small; skips where this process may
    not mount one (mounting needs root with CAP_SYS_ADMIN)."""
    import os
    import subprocess

    mount = tmp_path / "small"
    mounted = []

    def make(size: str = "1m"):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        mount.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(mount)
        return mount

    yield make
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def bind_mount(tmp_path):
    """tmp_path/src mounted again at tmp_path/bind: a mount point on the same file system, which
    os.path.ismount does not report; skips where this process may not mount (root with CAP_SYS_ADMIN)."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("a bind mount needs root")
    src, bind = tmp_path / "src", tmp_path / "bind"
    src.mkdir()
    bind.mkdir()
    done = subprocess.run(["mount", "--bind", str(src), str(bind)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr.strip()}")
    yield bind
    subprocess.run(["umount", "-l", str(bind)], check=False)


@pytest.fixture
def wide_consoles(monkeypatch):
    """Keep rich from wrapping long paths in messages, so assertions can look for them whole."""
    import cli.common

    monkeypatch.setattr(cli.common.console, "width", 400)
    monkeypatch.setattr(cli.common.err_console, "width", 400)


# --- the pid of a process that has ended: names of temporary folders carry their writer's pid -------------
@pytest.fixture
def dead_pid() -> int:
    """The pid of a child that ran and was reaped (pids are not handed out again that soon)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
