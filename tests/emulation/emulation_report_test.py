"""The emulation report (jaxpe.emulation.report): its tables keep measured deviations within the
predicted bounds."""

from jaxpe.emulation import report as emulation_report


def test_report_tables_have_measured_within_predicted(tmp_path):
  path = tmp_path / "deviation.png"
  text = emulation_report.report(
    num_heads=3, head_dim=8, contexts=[300], dtypes=["bfloat16"], queries=4, plot=str(path)
  )
  assert path.stat().st_size > 10_000
  rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
  per_head = [[c.strip() for c in row] for row in rows if len(row) == 12 and row[0].strip().isdigit()]
  assert len(per_head) == 2 * 3  # (bf16 policy, bf16 without) x 3 heads
  for row in per_head:
    values = [float(c) for c in row[4:]]
    for pred, meas in zip(values[0::2], values[1::2]):
      assert meas <= pred, row
  assert "Base-constrained mode: base 10000" in text
