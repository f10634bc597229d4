import pytest

from sidecar.scheduling.overdue import FirstByteWatch, OverdueConfig


class Req:
    """A request stand-in: known by identity, as RequestContext is."""


def expected(values):
    return lambda cluster: values.get(cluster)


def test_a_request_is_overdue_past_factor_times_the_usual_first_byte_and_reported_once():
    watch = FirstByteWatch(OverdueConfig(factor=3, min_s=1))
    old, new = Req(), Req()
    watch.add("a", old, sent_at=0.0)
    watch.add("a", new, sent_at=2.0)
    usual = expected({"a": 0.5})                                 # 3 x 0.5 = 1.5 s
    assert watch.take_overdue(1.4, usual) == []
    assert watch.take_overdue(1.5, usual) == [old]
    assert watch.take_overdue(3.4, usual) == []                  # old was reported already
    assert watch.take_overdue(3.5, usual) == [new]
    assert watch.waiting("a") == 0


def test_never_sooner_than_the_floor_and_never_without_a_measurement():
    watch = FirstByteWatch(OverdueConfig(factor=3, min_s=1))
    r = Req()
    watch.add("a", r, 0.0)
    assert watch.take_overdue(0.9, expected({"a": 0.01})) == []  # 3 x 0.01 is below the 1 s floor
    assert watch.take_overdue(100.0, expected({})) == []         # nothing known about a: no verdict
    assert watch.take_overdue(1.0, expected({"a": 0.01})) == [r]


def test_answered_or_ended_requests_leave_the_watch():
    watch = FirstByteWatch()
    first, second = Req(), Req()
    watch.add("a", first, 0.0)
    watch.add("b", second, 0.0)
    watch.remove("a", first)
    watch.remove("a", Req())                                     # unknown: nothing happens
    watch.remove("c", first)
    assert watch.take_overdue(60.0, expected({"a": 0.1, "b": 0.1})) == [second]


@pytest.mark.parametrize("kwargs", [{"factor": 0.5}, {"min_s": 0}, {"min_s": float("nan")}])
def test_bad_config_is_refused(kwargs):
    with pytest.raises(ValueError):
        OverdueConfig(**kwargs)
