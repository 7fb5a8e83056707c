"""`ops` binds each hot op once per process to the family `device.kernel_family()` picks, and
SGLANG_DSV4_FORCE_REFERENCE=1 forces the plain-torch reference everywhere."""

import os
import subprocess
import sys
import textwrap


def _bound(env, family=None):
    code = textwrap.dedent(f"""
        from sglang_dsv4_ascend import device
        if {family!r} is not None:
            device.device_family.cache_clear()
            device.device_family = lambda: {family!r}
        from sglang_dsv4_ascend import ops
        assert ops.sparse_attention_sources.__module__ == ops.sparse_attention_with_sink.__module__
        print(ops.KERNEL_FAMILY, ops.sparse_attention_with_sink.__module__, ops.rms_norm.__module__,
              ops.mhc_weights.__module__)
    """)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_cpu_uses_reference_with_scripted_mhc_and_force_reference_undoes_it():
    fam, attn, norm, mhc = _bound({"SGLANG_DSV4_FORCE_REFERENCE": "0"})
    assert fam == "cpu" and attn.endswith("ops.reference") and norm.endswith("ops.reference")
    assert mhc.endswith("ops.scripted")
    fam, _, _, mhc = _bound({"SGLANG_DSV4_FORCE_REFERENCE": "1"})
    assert fam == "reference" and mhc.endswith("ops.reference")


def test_cuda_binds_triton_kernel_and_force_reference_undoes_it():
    fam, attn, norm, _ = _bound({"SGLANG_DSV4_FORCE_REFERENCE": "0"}, family="cuda")
    assert fam == "triton" and attn.endswith("ops.triton.sparse_attention") and norm.endswith("ops.reference")
    fam, attn, _, _ = _bound({"SGLANG_DSV4_FORCE_REFERENCE": "1"}, family="cuda")
    assert fam == "reference" and attn.endswith("ops.reference")


def test_npu_binds_torch_npu_ops_and_keeps_the_eager_mhc():
    fam, attn, norm, mhc = _bound({"SGLANG_DSV4_FORCE_REFERENCE": "0"}, family="npu")
    assert fam == "npu" and norm.endswith("ops.npu") and mhc.endswith("ops.reference")
    assert attn.endswith("ops.npu")


def test_every_family_table_builds_in_process_hot_ops_and_w8a8_alike():
    from sglang_dsv4_ascend import ops
    from sglang_dsv4_ascend.ops import quant, reference

    ref, cpu, tri, npu = (ops.kernels(f) for f in ("reference", "cpu", "triton", "npu"))
    assert all(getattr(ref, name) is getattr(reference, name) for name in ops.HOT_OPS)
    assert ref.quant_matmul is quant.quant_matmul and ref.weight_layout == "nk"
    assert cpu.mhc_weights.__module__.endswith("ops.scripted") and cpu.quant_matmul is quant.quant_matmul
    assert tri.sparse_attention_with_sink.__module__.endswith("ops.triton.sparse_attention")
    assert tri.quant_matmul.__module__.endswith("ops.triton.quant") and tri.static_quant is quant.static_quant
    assert npu.rms_norm.__module__.endswith("ops.npu") and npu.weight_layout == "kn"
    assert ops.kernels("cpu") is cpu  # one table per family and process
    assert ops.rms_norm is ops.active().rms_norm and ops.KERNEL_FAMILY == ops.active().family


def test_importing_ops_binds_nothing():
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import sys
        from sglang_dsv4_ascend import ops
        print(sorted(m for m in sys.modules if m.startswith(("sglang_dsv4_ascend.ops.", "triton"))))
        print(ops.active.cache_info().currsize)
    """),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    loaded, active = r.stdout.split("\n")[:2]
    assert loaded == "['sglang_dsv4_ascend.ops.quant', 'sglang_dsv4_ascend.ops.reference']" and active == "0"


def test_capture_logs_see_the_memory_a_capture_adds():
    """device.memory_mib (what the capture log lines report on CPU: the resident set) grows by what
    a new tensor touches."""
    import torch

    from sglang_dsv4_ascend.device import memory_mib

    before = memory_mib()
    held = torch.ones(64, 2**20 // 4)  # 64 MiB, every page written
    assert memory_mib() - before > 48, (before, memory_mib())
    del held
