"""Stage events: under capture the record is an external event node; outside capture the driver
refuses that flag (CUDA driver API: "invalid when used outside of capture"), so the record is plain."""

from types import SimpleNamespace

from cupymoe import profiling


class _Driver:
    def __init__(self):
        self.calls = []

    def cuEventRecordWithFlags(self, event, stream, flags):
        self.calls.append((event, stream, flags))
        return 0


def test_stage_events_record_external_only_under_capture(monkeypatch):
    driver = _Driver()
    monkeypatch.setattr(profiling, "_libcuda", driver)
    event = SimpleNamespace(ptr=7)
    for capturing, flag in ((True, 1), (False, 0)):
        stream = SimpleNamespace(ptr=11, is_capturing=lambda c=capturing: c)
        profiling._record_external(event, stream)
        assert driver.calls[-1] == (7, 11, flag)
