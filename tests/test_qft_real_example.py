"""examples/qft_real.py --smoke on the real SmolLM2-135M-Instruct: every arm trains through Trainer, losses are
finite, QFT's quantized weights move, and the report files are written."""
import json
import math
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.real_model
def test_qft_real_smoke(smollm2, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    sys.modules.pop("qft_real", None)
    import qft_real

    summary = qft_real.main(["--smoke", "--model", smollm2, "--out", str(tmp_path)])
    data = json.loads((tmp_path / "qft_real.json").read_text())
    assert (tmp_path / "qft_real.md").stat().st_size > 0 and (tmp_path / "qft_real.png").stat().st_size > 0
    runs = {r["arm"]: r for r in data["runs"]}
    assert set(runs) == {"bf16 AdamW", "fp32 Lion", "QFT"}
    for arm, r in runs.items():
        assert len(r["train_loss"]) == 2, arm
        losses = r["train_loss"] + [r["initial_eval_loss"], r["final_eval_loss"]] + [e[1] for e in r["evals"]]
        assert all(math.isfinite(x) and 0 < x < 20 for x in losses), (arm, losses)
        assert r["evals"][0][0] == 0 and r["evals"][-1][0] == 2, arm
    # Held-out loss of the checkpoint itself: a pretrained model, far below uniform over the vocabulary (ln 49152).
    assert runs["fp32 Lion"]["initial_eval_loss"] < 6
    q = runs["QFT"]
    wc = q["weight_change"]
    assert wc["decoder_linears"]["changed_fraction"] > 0.01 and wc["checksum_after"] != wc["checksum_before"]
    assert q["final_eval_loss"] != q["initial_eval_loss"]
    # The decoder linears of QFT hold INT8 weights, INT8 gradients and INT8 momentum: ~1 byte each + row metadata and
    # outliers, well under fp32 Lion's 12 bytes per parameter.
    assert q["memory"]["decoder_linears"]["bytes_per_param"] < 4
    assert runs["fp32 Lion"]["memory"]["decoder_linears"]["bytes_per_param"] == pytest.approx(12, abs=0.01)
    assert summary["qft_vs_fp32_lion"] is not None and math.isfinite(summary["qft_vs_fp32_lion"]["gap_percent"])
    assert summary["best_lr"] == {"bf16 AdamW": 3e-5, "fp32 Lion": 1e-5, "QFT": 1e-5}
