"""Progress lines for long CLI work: drawn in place, rate-limited, only where shown."""
import io

from sidecar.service.progress import REDRAW_S, Progress, input_size


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_line_with_share_rate_and_time_left():
    clock = Clock()
    progress = Progress("pairs", total_bytes=1000, stream=io.StringIO(), show=True, clock=clock)
    clock.now += 10
    progress.advance(50, 250)
    assert progress.line(clock.now) == "pairs: 50, 25%, 0:30 left, 5.0/s"


def test_redraws_at_most_every_interval_and_ends_the_line():
    clock, out = Clock(), io.StringIO()
    progress = Progress("pairs", stream=out, show=True, clock=clock)
    for _ in range(100):
        progress.advance()
    assert out.getvalue() == ""                     # no line before there is a rate to show
    clock.now += REDRAW_S
    progress.advance()
    progress.advance()
    progress.done()
    assert out.getvalue().count("\r") == 2 and out.getvalue().endswith("pairs: 102, 510.0/s\n")


def test_nothing_when_not_a_terminal(tmp_path):
    out = io.StringIO()
    progress = Progress("pairs", stream=out)
    progress.advance()
    progress.done()
    assert out.getvalue() == ""
    data = tmp_path / "in.jsonl"
    data.write_text("x\n" * 10)
    with data.open() as stream:
        assert input_size(stream) == 20
    assert input_size(io.StringIO("x")) is None
