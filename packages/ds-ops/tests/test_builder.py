"""OpBuilder: JIT build into a keyed cache, cache hits without a compiler run, one build across
concurrent processes, incompatible flags reported with the reason, compiler errors surfaced."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
from _toy_ops import (
    BROKEN_SOURCE,
    GOOD_SOURCE,
    WITHOUT_TORCH,
    ToyBuilder,
    run_python,
    subprocess_env,
    write_toy,
)

from ds_ops.op_builder import CPUAdamBuilder, OpBuildError, OpNotCompatibleError, extensions_root


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private, empty JIT cache for one test."""
    path = tmp_path / "extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(path))
    return path


def test_torch_extensions_dir_is_honoured(cache: Path) -> None:
    assert extensions_root() == cache / "ds_ops"
    assert CPUAdamBuilder().cache_dir().parent == cache / "ds_ops"


def test_cache_key_covers_sources_flags_and_torch_version(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = write_toy(tmp_path / "src")
    base = ToyBuilder(root).cache_dir()
    assert base.name.startswith("toy_add_")
    assert ToyBuilder(root).cache_dir() == base  # stable
    assert ToyBuilder(root, extra_flags=("-DEXTRA=1",)).cache_dir() != base
    (root / "toy_add.cpp").write_text(GOOD_SOURCE + "// edited\n")
    assert ToyBuilder(root).cache_dir() != base
    (root / "toy_add.cpp").write_text(GOOD_SOURCE)
    monkeypatch.setattr("ds_ops.op_builder._base.torch_version", lambda: "9.9.9")
    assert ToyBuilder(root).cache_dir() != base
    parts = "\n".join(ToyBuilder(root).cache_parts())
    assert "-mavx2" in parts or "-mavx512f" in parts or "DS_SIMD_LEVEL" in parts  # SIMD level is in the key


def test_first_load_compiles_and_logs_one_line_with_duration(
    tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    builder = ToyBuilder(write_toy(tmp_path / "src"))
    with caplog.at_level("INFO", logger="ds_ops.op_builder"):
        library = builder.load()
    assert builder.loaded_from == "jit"
    assert library.toy_add(2, 40) == 42
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("compiling op toy_add") for m in messages) == 1, messages
    assert any(m.startswith("compiled op toy_add in ") and m.endswith(" s") for m in messages), messages
    assert (builder.cache_dir() / "toy_add.so").exists()
    assert (builder.cache_dir() / "build.ninja").exists()


CACHED_LOAD = textwrap.dedent("""
    import subprocess, sys
    from pathlib import Path
    from _toy_ops import ToyBuilder

    def no_process(*args, **kwargs):
        raise AssertionError(f"a cached load spawned a process: {args!r}")

    subprocess.Popen = no_process  # subprocess.run goes through Popen: no ninja, no compiler
    builder = ToyBuilder(Path(sys.argv[1]))
    library = builder.load()
    print(builder.loaded_from, library.toy_add(3, 4), "torch.utils.cpp_extension" in sys.modules,
          "torch" in sys.modules)
""")


def test_second_load_in_a_fresh_process_uses_the_cache_without_compiler(tmp_path: Path, cache: Path) -> None:
    root = write_toy(tmp_path / "src")
    ToyBuilder(root).load()
    result = run_python(WITHOUT_TORCH + CACHED_LOAD, subprocess_env(), args=(str(root),))
    assert result.stdout.split() == ["cache", "7", "False", "False"], result.stdout


RACE = textwrap.dedent("""
    import logging, os, sys, time
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from _toy_ops import ToyBuilder
    root, rank = Path(sys.argv[1]), sys.argv[2]
    (root / f"ready{rank}").touch()
    while not all((root / f"ready{r}").exists() for r in ("0", "1")):  # start together
        time.sleep(0.005)
    builder = ToyBuilder(root)
    library = builder.load()
    print("RESULT", builder.loaded_from, library.toy_add(20, 22))
""")


def test_two_processes_loading_at_once_build_once(tmp_path: Path, cache: Path) -> None:
    root = write_toy(tmp_path / "src")
    env = subprocess_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WITHOUT_TORCH + RACE, str(root), str(rank)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    results = sorted(line.split()[1:] for out, _ in outputs for line in out.splitlines() if line.startswith("RESULT"))
    assert results == [["cache", "42"], ["jit", "42"]], outputs
    logs = "".join(err for _, err in outputs)
    assert logs.count("compiling op toy_add") == 1, logs


def test_unsupported_flag_makes_the_op_incompatible_with_the_reason(tmp_path: Path, cache: Path) -> None:
    builder = ToyBuilder(write_toy(tmp_path / "src"), extra_flags=("-mdefinitely-not-a-real-flag",))
    compatibility = builder.is_compatible()
    assert not compatibility
    assert len(compatibility.reasons) == 1
    assert "compiler rejects this op's flags" in compatibility.reasons[0]
    assert "-mdefinitely-not-a-real-flag" in compatibility.reasons[0]  # the compiler's own message
    with pytest.raises(OpNotCompatibleError, match="toy_add cannot be built on this machine.*definitely-not"):
        builder.load()
    assert not builder.cache_dir().joinpath("toy_add.so").exists()


def test_missing_compiler_is_a_reason(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    compatibility = ToyBuilder(write_toy(tmp_path / "src")).is_compatible()
    assert not compatibility
    assert any("no-such-compiler" in r and "not found" in r for r in compatibility.reasons), compatibility


def test_broken_source_raises_the_compiler_error(tmp_path: Path, cache: Path) -> None:
    builder = ToyBuilder(write_toy(tmp_path / "src", BROKEN_SOURCE))
    with pytest.raises(OpBuildError) as info:
        builder.load()
    message = str(info.value)
    assert "compiling op 'toy_add' failed" in message
    assert "toy_add.cpp" in message and "undeclared_thing" in message and "error" in message
    assert "build.log" in message
    # The traceback ends in load(): no chained exception, no frames from the build machinery.
    assert info.value.__cause__ is None and info.value.__suppress_context__
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[-1].name == "load", frames
    # Fixing the source gives a new cache key and a working op.
    write_toy(tmp_path / "src", GOOD_SOURCE)
    assert builder.load().toy_add(1, 1) == 2


def test_a_prebuilt_library_of_another_op_is_rebuilt(cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A library lacking a function the builder declares (e.g. the CUDA fused_adam where the CPU one is
    wanted) does not load: the op is JIT-built instead."""
    from ds_ops.op_builder import CPULionBuilder  # noqa: PLC0415

    lion = CPULionBuilder().load()
    lion_path = Path(lion._name)

    class WrongPrebuilt(CPUAdamBuilder):
        def prebuilt_library(self) -> tuple[Path | None, str]:
            return lion_path, ""

    with caplog.at_level("WARNING", logger="ds_ops.op_builder._base"):
        library = WrongPrebuilt().load()
    assert hasattr(library, "ds_cpu_adam_step")
    assert any("does not export ds_cpu_adam_step" in record.getMessage() for record in caplog.records)


def test_not_implemented_builder_is_never_compatible() -> None:
    from ds_ops.op_builder import NotImplementedBuilder  # noqa: PLC0415

    builder = NotImplementedBuilder()
    assert builder.name == "deepspeed_not_implemented"
    assert not builder.is_compatible() and not builder.can_build() and not builder.prebuilt_installed()
    with pytest.raises(OpNotCompatibleError, match="not implemented in ds"):
        builder.load()
