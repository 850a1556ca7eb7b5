"""benchmarks/scaleout.py on CPU: the driver launches each row's job (accelerate launch with ddp.yaml; FSDP2 under
torchrun, as accelerate runs FSDP on GPUs only), collects the parts and writes the table through the harness."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "scaleout.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_tiny_table_end_to_end(tmp_path):
    # the CPU table on any machine: with a GPU visible the jobs would run there (and need one GPU per rank)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, SCRIPT, "--tiny", "--out", str(tmp_path), "--jobs",
                        "qft:ddp:1,qft:ddp:2,quest:fsdp2:2@3"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "scaleout_tiny.json").read_text())
    rows = {(x["method"], x["strategy"], x["world"]): x for x in doc["rows"]}
    assert set(rows) == {("qft", "ddp", 1), ("qft", "ddp", 2), ("quest", "fsdp2", 2)}
    assert all(x["status"] == "ok" and x["tokens_per_s"] > 0 for x in rows.values()), doc["rows"]
    assert rows["qft", "ddp", 2]["wrapper"] == "DistributedDataParallel"
    assert rows["qft", "ddp", 1]["wrapper"] == "Qwen2ForCausalLM"  # one process: accelerate wraps nothing
    assert rows["quest", "fsdp2", 2]["wrapper"].startswith("FSDP")
    two, one = rows["qft", "ddp", 2], rows["qft", "ddp", 1]
    assert abs(two["x_world1"] - two["tokens_per_s"] / one["tokens_per_s"]) < 0.01 * two["x_world1"]
    assert "x_world1" not in rows["quest", "fsdp2", 2]  # no world-1 row of quest in this run
    assert two["windows"] == 3 and two["tokens_per_step"] == 2 * 2 * 32  # 2 ranks x batch 2 x seq 32
    assert rows["quest", "fsdp2", 2]["batch"] == 3 and rows["quest", "fsdp2", 2]["tokens_per_step"] == 2 * 3 * 32
    md = (tmp_path / "scaleout_tiny.md").read_text()
    assert "device: cpu" in md and "| qft | ddp | 2 | tiny | 2 |" in md


def test_scaling_ratio_and_append_merge(tmp_path):
    """x_world1 comes from the windows' seconds per token (median ratio, worst-to-best range); --append keeps the
    earlier call's rows of other configurations and replaces those measured again."""
    import scaleout
    from _harness import spread, write

    def row(method, strategy, world, spt):
        return dict(method=method, strategy=strategy, world=world, model="m", batch=1, status="ok",
                    s_per_token=spread(spt))

    rows = [row("eco", "ddp", 1, [2.0, 2.2, 2.1]), row("eco", "fsdp2", 2, [1.0, 1.1, 1.2]),
            dict(method="qft", strategy="fsdp2", world=2, model="m", batch=1, status="failed: x")]
    scaleout.add_scaling(rows)
    assert rows[1]["x_world1"] == round(2.1 / 1.1, 3) and rows[1]["x_world1_of"] == "ddp w1"
    assert rows[1]["x_world1_range"] == f"{2.0 / 1.2:.2f}-{2.2 / 1.0:.2f}"
    assert "x_world1" not in rows[2]
    write("scaleout", rows, out_dir=str(tmp_path), facts={"date": "earlier"}, extra={"settings": {"batch": 1}})
    merged, calls = scaleout.merge("scaleout", [row("qft", "fsdp2", 2, [0.5])], str(tmp_path))
    assert [(r["method"], r["strategy"], r.get("call")) for r in merged] == [
        ("eco", "ddp", "earlier"), ("eco", "fsdp2", "earlier"), ("qft", "fsdp2", None)]
    assert calls == [{"date": "earlier"}]
    other = [dict(row("eco", "ddp", 1, [2.0]), call="2026-01-01 00:00 UTC abc1234"),
             dict(row("eco", "ddp", 2, [1.0]), call="2026-01-02 00:00 UTC abc1234")]
    scaleout.add_scaling(other)  # ratios only within one device call
    assert "x_world1" not in other[1]
    other[0]["call"] = "2026-01-02 00:00 UTC def5678"
    scaleout.add_scaling(other)
    assert other[1]["x_world1"] == 2.0
    other[1]["batch"] = 4  # and only between rows of one batch
    scaleout.add_scaling(other)
    assert "x_world1" not in other[1]
    merged, _ = scaleout.merge("scaleout", [dict(row("eco", "ddp", 1, [1.0]), batch=4)], str(tmp_path))
    assert [(r["method"], r["strategy"], r["batch"]) for r in merged][:2] == [("eco", "ddp", 1), ("eco", "fsdp2", 1)]
    assert merged[-1]["batch"] == 4 and len(merged) == 4
