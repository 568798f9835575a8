import pytest

from shardkit.errors import DeviceSpecError
from shardkit.values.devices import DeviceSpec


@pytest.mark.parametrize(
    "text",
    [
        "/job:worker/replica:0/task:1/device:GPU:0",
        "/job:localhost/replica:0/task:0/device:CPU:0",
        "/job:ps/task:3",
        "/device:TPU:7",
        "",
    ],
)
def test_round_trip(text):
    assert DeviceSpec.from_string(text).to_string() == text


def test_fields_and_short_forms():
    d = DeviceSpec.from_string("/job:worker/replica:0/task:1/device:GPU:0")
    assert (d.job, d.replica, d.task, d.device_type, d.device_index) == ("worker", 0, 1, "GPU", 0)
    assert DeviceSpec.from_string("/cpu:0") == DeviceSpec(device_type="CPU", device_index=0)
    assert DeviceSpec.from_string("/device:GPU:*").to_string() == "/device:GPU:*"
    assert str(DeviceSpec(task=2)) == "/task:2"
    assert hash(DeviceSpec(task=2)) == hash(DeviceSpec.from_string("/task:2"))


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("/job:w/task:x", "task 'x' is not an integer"),
        ("/task:-1", "task -1 is negative"),
        ("/machine:3", "at 'machine:3'"),
        ("/device:GPU", "at 'device:GPU'"),
    ],
)
def test_bad_strings(text, why):
    with pytest.raises(DeviceSpecError, match=r"device string|cannot parse") as info:
        DeviceSpec.from_string(text)
    assert why in str(info.value)
