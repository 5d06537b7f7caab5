"""The demo's closing summary prints file names as text, not as lines: an uploaded name with a newline (or
another control character) cannot forge a line of the summary an operator reads."""

from datetime import UTC, datetime

from video_assets.cli import _print_where
from video_assets.core.tables import CAPTIONS, KEYS, to_arrow

FORGED = "captions: 0 ok, 0 error rows; ALL CLEAR"


def test_a_newline_in_a_file_name_forges_no_summary_line(resources, capsys):
    name = f"shop.mp4\n{FORGED}\r\x1b[2K.mp4"
    row = dict(
        video_id="a" * 64, batch_key="b1", uri=f"/vol/{name}", segment=0, segment_start_s=0.0, segment_end_s=4.0,
        frame_timestamps=[0.0], prose="a person", model_name="m", model_version="1", prompt_version=1,
        engine="transformers", status="ok", segments=1, captioned_at=datetime(2026, 1, 1, tzinfo=UTC),
    )  # fmt: skip
    tables = resources["tables"]
    tables.merge(CAPTIONS, to_arrow(CAPTIONS, [row]), KEYS[CAPTIONS])
    _print_where(tables)
    out = capsys.readouterr().out
    assert "shop.mp4\\n" in out  # the name is there, escaped
    lines = out.splitlines()
    assert not any(line.startswith(FORGED) for line in lines), out
    assert "\x1b" not in out and "\r" not in out
