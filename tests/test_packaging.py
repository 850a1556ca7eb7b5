"""A built wheel, installed (not editable) in a fresh venv, carries the model cards and the tuned kernel tables."""
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHECK = r"""
import json, pathlib, sys
import hfq, hfq_kernels, hfq.hub
from hfq_kernels._autotune import Tuner
site = pathlib.Path(sys.argv[1]).resolve()
for mod in (hfq, hfq_kernels):
    assert pathlib.Path(mod.__file__).resolve().is_relative_to(site), (mod.__name__, mod.__file__)
cards = sorted(p.name for p in hfq.hub.CARDS_DIR.iterdir())
assert not hfq.hub.CARDS_DIR.is_symlink()
text = hfq.hub.render("lora_adapter.md", base_model="b", method="qerl", model_name="m", repo_id="me/m", r=8,
                      lora_alpha=16, target_modules="q_proj", training_summary="", base_format="NVFP4")
tables = {}
for path in pathlib.Path(hfq_kernels.__file__).parent.glob("*_tuned.json"):
    op = path.name.removesuffix("_tuned.json")
    tables[op] = len(Tuner(op).cache)
    assert tables[op] == len(json.loads(path.read_text())[op]) > 0, op
print(json.dumps({"cards": cards, "tables": tables, "card_len": len(text)}))
"""


def _copy_tree(dst: Path) -> Path:
    """The checkout as a fresh clone would have it (no build outputs, caches or venvs)."""
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist", ".venv", ".pytest_cache",
                                    ".hypothesis", "runs", "hfq_cache")
    shutil.copytree(REPO, dst, symlinks=True, ignore=ignore)
    return dst


def test_wheel_install_has_cards_and_tuned_tables(tmp_path):
    src = _copy_tree(tmp_path / "src")
    # No PYTHONPATH: a checkout on it (with a stray hfq.egg-info) would make pip think hfq is already installed.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300, env=env)
    (wheel,) = (tmp_path / "dist").glob("hfq-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, capture_output=True, timeout=300, env=env)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # torch/transformers come from this interpreter's site-packages, after the venv's own (where hfq is).
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    r = subprocess.run([str(py), "-I", "-c", CHECK, str(site)], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["cards"] == sorted(p.name for p in (REPO / "model_cards").glob("*.md"))
    assert set(got["tables"]) == {p.name.removesuffix("_tuned.json") for p in (REPO / "hfq_kernels").glob("*_tuned.json")}
    assert got["card_len"] > 100
    assert (env_dir / "bin" / "hfq").is_file()
