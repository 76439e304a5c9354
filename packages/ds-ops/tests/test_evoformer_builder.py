"""EvoformerAttnBuilder: CUTLASS found from each place it may be (fake CUTLASS trees), its version checked,
targets below compute capability 7.0 dropped, and a load that fails naming the missing kernel."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from ds_ops.op_builder import CUDAOpBuilder, EvoformerAttnBuilder, OpNotCompatibleError
from ds_ops.op_builder import _cutlass as cutlass

_real_package_roots = cutlass.python_package_roots  # the fixture below replaces it
_VARIABLES = ("CUTLASS_PATH", *cutlass.PREFIX_VARIABLES, *cutlass.INCLUDE_VARIABLES, "TORCH_CUDA_ARCH_LIST")


@pytest.fixture
def bare_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A host with no CUTLASS anywhere the builder looks: no variables, empty prefixes, an empty cwd."""
    for name in (*_VARIABLES, "DS_EVOFORMER_GPU_ARCH"):
        monkeypatch.delenv(name, raising=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    for attribute in ("prefix", "exec_prefix", "base_prefix"):
        monkeypatch.setattr(sys, attribute, str(empty))
    monkeypatch.setattr(cutlass, "CONVENTIONAL_PATHS", ())
    monkeypatch.setattr(cutlass, "python_package_roots", lambda: [])
    monkeypatch.chdir(empty)
    return tmp_path


def fake_cutlass(root: Path, version: tuple[int, int, int] | None = (3, 5, 1), util: bool = True) -> Path:
    """A CUTLASS checkout at `root`: the marker header, version.h (when `version`), tools/util/include (when `util`)."""
    headers = root / "include" / "cutlass"
    headers.mkdir(parents=True)
    (headers / "cutlass.h").write_text("#pragma once\n")
    if version is not None:
        major, minor, patch = version
        defines = f"#define CUTLASS_MAJOR {major}\n#define CUTLASS_MINOR {minor}\n#define CUTLASS_PATCH {patch}\n"
        (headers / "version.h").write_text("#pragma once\n" + defines)
    if util:
        (root / "tools" / "util" / "include").mkdir(parents=True)
    return root


def expected_dirs(root: Path, util: bool = True) -> list[str]:
    root = root.resolve()
    return [str(root / "include"), *([str(root / "tools" / "util" / "include")] if util else [])]


def test_cutlass_path_may_be_the_checkout_or_its_include_folder(
    bare_host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = fake_cutlass(bare_host / "my-cutlass")
    monkeypatch.setenv("CUTLASS_PATH", str(root))
    assert EvoformerAttnBuilder().include_paths() == expected_dirs(root)
    monkeypatch.setenv("CUTLASS_PATH", str(root / "include"))
    assert EvoformerAttnBuilder().include_paths() == expected_dirs(root)


def test_cutlass_path_is_read_when_the_builder_is_made(bare_host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_cutlass(bare_host / "c")
    monkeypatch.setenv("CUTLASS_PATH", str(root))
    builder = EvoformerAttnBuilder()
    monkeypatch.delenv("CUTLASS_PATH")
    assert builder.cutlass_path == str(root)
    assert builder.include_paths() == expected_dirs(root)


def test_an_install_prefix_without_tools_gives_only_its_include_folder(
    bare_host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = fake_cutlass(bare_host / "prefix", util=False)
    monkeypatch.setenv("CONDA_PREFIX", str(root))
    assert EvoformerAttnBuilder().include_paths() == expected_dirs(root, util=False)


@pytest.mark.parametrize("variable", ["CUTLASS_ROOT", "CUTLASS_HOME", "VIRTUAL_ENV", "CMAKE_PREFIX_PATH", "CUDA_HOME"])
def test_found_under_a_prefix_variable(bare_host: Path, monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    root = fake_cutlass(bare_host / "prefix")
    # a path list: the first entry holds nothing, the second holds CUTLASS
    monkeypatch.setenv(variable, f"{bare_host / 'nothing'}:{root}")
    assert EvoformerAttnBuilder().include_paths() == expected_dirs(root)


@pytest.mark.parametrize("variable", ["CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH"])
def test_found_through_a_compiler_include_variable(
    bare_host: Path, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    root = fake_cutlass(bare_host / "sys")
    monkeypatch.setenv(variable, str(root / "include"))
    assert EvoformerAttnBuilder().include_paths() == expected_dirs(root)


def test_found_in_a_clone_in_the_working_directory(bare_host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = bare_host / "project"
    root = fake_cutlass(work / "cutlass")
    monkeypatch.chdir(work)
    assert EvoformerAttnBuilder().include_paths() == expected_dirs(root)


def test_found_under_this_pythons_prefix(bare_host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_cutlass(bare_host / "venv")
    monkeypatch.setattr(sys, "prefix", str(root))
    assert EvoformerAttnBuilder().include_paths() == expected_dirs(root)


def test_the_pip_package_comes_before_the_variables(bare_host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = fake_cutlass(bare_host / "site-packages" / "cutlass_library" / "source")
    prefix = fake_cutlass(bare_host / "prefix")
    monkeypatch.setenv("CMAKE_PREFIX_PATH", str(prefix))
    monkeypatch.setattr(cutlass, "python_package_roots", lambda: [package])
    assert EvoformerAttnBuilder().include_paths() == expected_dirs(package)


def test_python_package_roots_reads_the_installed_package(bare_host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the real lookup, with a fake `cutlass_library` package on sys.path
    site = bare_host / "site"
    package = site / "cutlass_library"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"source_path = {str(bare_host / 'src-tree')!r}\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "cutlass_library", raising=False)
    roots = _real_package_roots()
    monkeypatch.delitem(sys.modules, "cutlass_library", raising=False)
    assert roots == [bare_host / "src-tree", package.resolve() / "source", site.resolve(), package.resolve()]


def test_python_bindings_mode_uses_only_the_package(bare_host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTLASS_PATH", EvoformerAttnBuilder.CUTLASS_PYTHON_BINDINGS)
    monkeypatch.setenv("CMAKE_PREFIX_PATH", str(fake_cutlass(bare_host / "prefix")))
    with pytest.raises(ImportError, match="nvidia-cutlass Python package, which is not installed"):
        EvoformerAttnBuilder().include_paths()
    package = fake_cutlass(bare_host / "pkg")
    monkeypatch.setattr(cutlass, "python_package_roots", lambda: [package])
    assert EvoformerAttnBuilder().include_paths() == expected_dirs(package)


def test_ignore_mode_adds_no_include_folder_and_checks_nothing(
    bare_host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUTLASS_PATH", EvoformerAttnBuilder.CUTLASS_IGNORE)
    builder = EvoformerAttnBuilder()
    assert builder.include_paths() == []
    assert builder.cutlass_problems() == []
    assert builder.compatibility_notes() == ["CUTLASS detection is off (CUTLASS_PATH=DS_IGNORE_CUTLASS_DETECTION)"]


def test_missing_cutlass_is_an_error_that_says_where_it_looked_and_what_to_do(bare_host: Path) -> None:
    builder = EvoformerAttnBuilder()
    with pytest.raises(RuntimeError, match="Unable to locate CUTLASS") as caught:
        builder.include_paths()
    message = str(caught.value)
    assert str(bare_host / "empty" / "cutlass") in message
    assert "pip install nvidia-cutlass" in message and "set CUTLASS_PATH" in message


def test_a_cutlass_path_without_headers_is_named(bare_host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wrong = bare_host / "not-cutlass"
    wrong.mkdir()
    monkeypatch.setenv("CUTLASS_PATH", str(wrong))
    with pytest.raises(RuntimeError, match=f"CUTLASS_PATH={wrong} holds neither include/cutlass/cutlass.h"):
        EvoformerAttnBuilder().include_paths()


def test_cutlass_older_than_3_1_is_a_build_problem(bare_host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = fake_cutlass(bare_host / "old", version=(2, 11, 0))
    monkeypatch.setenv("CUTLASS_PATH", str(old))
    builder = EvoformerAttnBuilder()
    assert builder.cutlass_problems() == [
        f"CUTLASS at {old.resolve()} is 2.11.0; Evoformer attention needs 3.1.0 or newer"
    ]
    assert any("2.11.0" in problem for problem in builder.build_problems())
    for version, notes in (((3, 1, 0), "CUTLASS 3.1.0 at"), (None, "CUTLASS version unknown at")):
        root = fake_cutlass(bare_host / f"v{version}", version=version)
        monkeypatch.setenv("CUTLASS_PATH", str(root))
        builder = EvoformerAttnBuilder()
        assert builder.cutlass_problems() == []
        assert builder.compatibility_notes() == [f"{notes} {root.resolve()}"]


def test_filter_ccs_keeps_tensor_core_targets_and_warns_about_the_rest(
    bare_host: Path, caplog: pytest.LogCaptureFixture
) -> None:
    builder = EvoformerAttnBuilder()
    with caplog.at_level(logging.WARNING, logger="ds_ops.op_builder"):
        kept = builder.filter_ccs(["5.2", "6.1", "7.5", "9.0a", "10.0+PTX"])
    assert kept == [["7", "5"], ["9", "0a"], ["10", "0+PTX"]]
    assert "excluding targets below SM 7.0: [['5', '2'], ['6', '1']]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ds_ops.op_builder"):
        assert builder.filter_ccs(["8.0"]) == [["8", "0"]]
    assert caplog.text == ""
    # the base class keeps every target
    assert CUDAOpBuilder.filter_ccs(builder, ["6.0", "8.0+PTX"]) == [["6", "0"], ["8", "0+PTX"]]


def test_nvcc_args_target_only_the_kept_architectures(bare_host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_cutlass(bare_host / "c")
    monkeypatch.setenv("CUTLASS_PATH", str(root))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "6.0;7.0;8.6+PTX")
    args = EvoformerAttnBuilder().nvcc_args()
    gencodes = [arg for arg in args if arg.startswith("-gencode")]
    assert gencodes == [
        "-gencode=arch=compute_70,code=sm_70",
        "-gencode=arch=compute_86,code=sm_86",
        "-gencode=arch=compute_86,code=compute_86",
    ]
    assert [arg for arg in args if arg.startswith("-I")] == [f"-I{path}" for path in expected_dirs(root)]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "6.0;6.1")
    with pytest.raises(ValueError, match=r"op evoformer_attn supports none of the CUDA targets \['6.0', '6.1'\]"):
        EvoformerAttnBuilder().nvcc_args()


def test_the_old_gpu_arch_variable_is_ignored_with_a_warning(
    bare_host: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CUTLASS_PATH", EvoformerAttnBuilder.CUTLASS_IGNORE)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    plain = EvoformerAttnBuilder().nvcc_args()
    monkeypatch.setenv("DS_EVOFORMER_GPU_ARCH", "80")
    with caplog.at_level(logging.WARNING, logger="ds_ops.op_builder"):
        args = EvoformerAttnBuilder().nvcc_args()
    assert args == plain and not any("GPU_ARCH" in arg for arg in args)
    assert "DS_EVOFORMER_GPU_ARCH is deprecated and ignored" in caplog.text


def test_never_compatible_and_load_names_the_missing_kernel(bare_host: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builder = EvoformerAttnBuilder()
    compatibility = builder.is_compatible()
    assert not compatibility
    assert compatibility.reasons[0].startswith("ds-ops ships no Evoformer attention kernel")
    assert any("Unable to locate CUTLASS" in note for note in compatibility.notes)
    assert not builder.can_build()
    assert not builder.prebuilt_installed()
    with pytest.raises(
        OpNotCompatibleError, match="op evoformer_attn cannot be loaded: ds-ops ships no Evoformer"
    ) as e:
        builder.load()
    assert "Unable to locate CUTLASS" in str(e.value)  # every problem of this host, not only the first
    # with CUTLASS in place the kernel is still missing: nothing is built
    monkeypatch.setenv("CUTLASS_PATH", str(fake_cutlass(bare_host / "c")))
    builder = EvoformerAttnBuilder()
    with pytest.raises(OpNotCompatibleError, match="no Evoformer attention kernel") as e:
        builder.load()
    assert "CUTLASS" not in str(e.value).split("so there is nothing to build")[1]
    assert builder.loaded_from is None
