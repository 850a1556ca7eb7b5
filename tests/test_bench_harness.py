"""benchmarks/_harness.commit(): the commit a result records names the tree that ran, or says it does not."""
import importlib.util
import os
import shutil
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def _harness_in(repo):
    os.makedirs(repo / "benchmarks")
    shutil.copy(os.path.join(ROOT, "benchmarks", "_harness.py"), repo / "benchmarks" / "_harness.py")
    spec = importlib.util.spec_from_file_location("_harness_copy", repo / "benchmarks" / "_harness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_commit_marks_a_tree_that_differs_from_head(tmp_path, monkeypatch):
    """HEAD when the tracked files are HEAD's (untracked ones aside), HEAD+modified when one differs (a device copy
    whose .git is older than its files), HFQ_COMMIT over both, "unknown" without git metadata."""
    monkeypatch.delenv("HFQ_COMMIT", raising=False)
    repo = tmp_path / "repo"
    h = _harness_in(repo)
    assert h.commit() == "unknown"
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "--short", "HEAD")
    (repo / "scratch.txt").write_text("untracked")
    assert h.commit() == head
    with open(repo / "benchmarks" / "_harness.py", "a") as f:
        f.write("\n# changed\n")
    assert h.commit() == head + "+modified"
    monkeypatch.setenv("HFQ_COMMIT", "abc1234")
    assert h.commit() == "abc1234"
