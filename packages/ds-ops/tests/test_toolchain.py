"""Toolchain pieces: SIMD detection from /proc/cpuinfo and compiler macros, which builds a CPU can run,
the build.ninja text, CUDA arch lists, prebuilt-library selection and DS_BUILD_* selection."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

from ds_ops.op_builder import ALL_OPS, SIMD_FLAGS, CPUAdamBuilder, detect_simd, selected_ops
from ds_ops.op_builder._cuda import gencode_flags, parse_arch_list
from ds_ops.op_builder._ninja import NinjaSpec, render
from ds_ops.op_builder._prebuilt import usable_prebuilt
from ds_ops.op_builder._toolchain import can_run, simd_from_cpuinfo, simd_from_macros

AVX512_CPU = "processor : 0\nflags : fpu sse sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq\n"
AVX2_CPU = "processor : 0\nflags : fpu sse sse2 avx avx2 fma f16c\n"
OLD_CPU = "processor : 0\nflags : fpu sse sse2 sse4_2 avx\n"


def test_simd_level_from_cpuinfo() -> None:
    assert simd_from_cpuinfo(AVX512_CPU, "x86_64") == "avx512"
    assert simd_from_cpuinfo(AVX2_CPU, "x86_64") == "avx2"
    assert simd_from_cpuinfo(OLD_CPU, "x86_64") == "none"
    assert simd_from_cpuinfo("Features : fp asimd evtstrm\n", "aarch64") == "neon"


def test_simd_level_from_compiler_macros() -> None:
    assert simd_from_macros("#define __AVX2__ 1\n#define __FMA__ 1\n#define __F16C__ 1\n") == "avx2"
    assert simd_from_macros("#define __ARM_NEON 1\n") == "neon"
    assert simd_from_macros("#define __SSE2__ 1\n") == "none"


def test_this_cpu_level_is_known_and_in_the_flags() -> None:
    level = detect_simd()
    assert level in SIMD_FLAGS
    args = CPUAdamBuilder().cxx_args()
    assert f'-DDS_SIMD_LEVEL="{level}"' in args
    assert all(flag in args for flag in SIMD_FLAGS[level])
    assert "-fopenmp" in args and "-O3" in args


def test_which_builds_a_cpu_can_run() -> None:
    assert can_run("avx2", "avx512") and can_run("none", "avx2")
    assert not can_run("avx512", "avx2") and not can_run("neon", "avx2") and not can_run("avx2", "neon")


def test_ninja_file_compiles_each_source_and_links_once(tmp_path: Path) -> None:
    spec = NinjaSpec(
        sources=(tmp_path / "a b.cpp", tmp_path / "k.cu"),
        output="op.so",
        cxx="g++",
        cxx_flags=("-O3", '-DX="y"'),
        ldflags=("-shared",),
        nvcc="/cuda/bin/nvcc",
        nvcc_flags=("-O3",),
    )
    text = render(spec)
    assert "build 0_a_b.o: cxx " + str(tmp_path / "a$ b.cpp").replace(":", "$:") in text
    assert "build 1_k.o: nvcc" in text
    assert "build op.so: link 0_a_b.o 1_k.o" in text
    assert "command = $nvcc $in $ldflags -o $out" in text  # a .cu source links with nvcc
    assert "cxx_flags = -O3 '-DX=\"y\"'" in text
    with pytest.raises(ValueError, match="needs nvcc"):
        render(NinjaSpec(sources=(tmp_path / "k.cu",), output="op.so", cxx="g++", cxx_flags=(), ldflags=()))


def test_cuda_arch_list_parsing() -> None:
    assert parse_arch_list("8.0;9.0+PTX") == ["8.0", "9.0+PTX"]
    assert parse_arch_list(" 7.5 8.6 ") == ["7.5", "8.6"]
    assert gencode_flags(["8.0", "9.0+PTX"]) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST entry 'Hopper' is not like '9.0'"):
        parse_arch_list("8.0;Hopper")


def _manifest(tmp_path: Path, **entry: object) -> Path:
    tmp_path.mkdir(parents=True)
    (tmp_path / "cpu_adam.so").write_bytes(b"")
    (tmp_path / "manifest.json").write_text(json.dumps({"cpu_adam": {"file": "cpu_adam.so", **entry}}))
    return tmp_path


def test_prebuilt_library_is_used_only_where_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ds_ops.op_builder._prebuilt.detect_simd", lambda: "avx2")
    here = platform.machine()
    ok = _manifest(tmp_path / "ok", simd="avx2", machine=here, abi=1)
    assert usable_prebuilt("cpu_adam", 1, ok) == (ok / "cpu_adam.so", "")
    wide = _manifest(tmp_path / "wide", simd="avx512", machine=here, abi=1)
    assert usable_prebuilt("cpu_adam", 1, wide) == (None, "built for SIMD level avx512, this CPU has avx2")
    other = _manifest(tmp_path / "other", simd="none", machine="riscv64", abi=1)
    assert usable_prebuilt("cpu_adam", 1, other)[1].startswith("built for riscv64")
    stale = _manifest(tmp_path / "stale", simd="none", machine=here, abi=0)
    assert "op ABI 0" in usable_prebuilt("cpu_adam", 1, stale)[1]
    assert usable_prebuilt("cpu_adam", 1, tmp_path / "missing") == (None, "not in the wheel")


def test_ds_build_variables_select_ops() -> None:
    ops = list(ALL_OPS)
    assert selected_ops({}, ops) == {}
    assert selected_ops({"DS_BUILD_OPS": "1"}, ops) == dict.fromkeys(ops, False)
    assert selected_ops({"DS_BUILD_OPS": "1", "DS_BUILD_FUSED_ADAM": "0"}, ops) == {
        name: False for name in ops if name != "fused_adam"
    }
    assert selected_ops({"DS_BUILD_CPU_ADAM": "1"}, ops) == {"cpu_adam": True}
    assert selected_ops({"DS_BUILD_OPS": "0", "DS_BUILD_CPU_LION": "true"}, ops) == {"cpu_lion": True}
    with pytest.raises(ValueError, match="DS_BUILD_CPU_ADAM='maybe' is not a boolean; use DS_BUILD_CPU_ADAM=1"):
        selected_ops({"DS_BUILD_CPU_ADAM": "maybe"}, ops)
    with pytest.raises(ValueError, match="unknown op variable.*DS_BUILD_SPARSE_ATTN.*DS_BUILD_CPU_ADAM"):
        selected_ops({"DS_BUILD_SPARSE_ATTN": "1"}, ops)
