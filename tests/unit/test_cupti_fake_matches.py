"""The fake CUPTI and ccld's use of CUPTI match the installed cupti-python (names, values, record
fields, exception), and ccld's capture reads REAL record objects correctly. No GPU needed: real
record objects are built from NumPy arrays of the real dtypes (`ActivityKernel13.from_data`)."""
import ctypes
import os

import pytest

from ccld.cupti import inject
from ccld.cupti.capture import REC_API, REC_KERNEL, REC_MEMCPY, Capture, CaptureConfig
from ccld.cupti.shim import Shim
import fake_cupti
from fake_cupti import FakeCupti

pytestmark = pytest.mark.unit

cupti = pytest.importorskip("cupti.cupti", reason="cupti-python is not installed (scripts/setup.sh installs "
                                                   "it: pip install -e '.[cupti]')")
np = pytest.importorskip("numpy")


def test_every_cupti_call_ccld_makes_exists_in_cupti_python(tmp_path):
    fake = FakeCupti(selective_api=False)  # also exercises the whole-kinds path
    shim = Shim(fake, f"ipc://{tmp_path}/none", CaptureConfig(kernels="all", memcpy=True, memset=True),
                flush_interval_s=3600).start()
    fake.launch(fake_cupti.__name__)
    shim.tick()
    shim.shutdown()
    called = set(fake.calls)
    assert {"activity_register_callbacks", "activity_flush_all", "activity_get_num_dropped_records",
            "finalize", "get_timestamp", "set_thread_id_type"} <= called
    missing = sorted(c for c in called | {"activity_enable_runtime_api", "activity_enable_driver_api"}
                     if not callable(getattr(cupti, c, None)))
    assert missing == []


@pytest.mark.parametrize("enum_name", ["ActivityKind", "ActivityFlag", "ActivityThreadIdType",
                                       "runtime_api_trace_cbid", "driver_api_trace_cbid"])
def test_fake_enums_have_the_real_values(enum_name):
    real, fake = getattr(cupti, enum_name), getattr(fake_cupti, enum_name)
    for name, member in fake.__members__.items():
        assert int(real[name]) == int(member), f"{enum_name}.{name}"


@pytest.mark.parametrize("cls", ["ActivityKernel13", "ActivityAPI", "ActivityMemcpy7", "ActivityMemset4"])
def test_fake_records_carry_real_field_names(cls):
    real = getattr(cupti, cls)
    missing = [f for f in getattr(fake_cupti, cls).FIELDS if not hasattr(real, f)]
    assert missing == []


def test_kernel_record_size_matches():
    assert cupti.activity_kernel13_dtype.itemsize == fake_cupti.RECORD_BYTES


def test_no_gpu_error_is_what_ccld_recognizes():
    import cupti._internal.utils as utils
    assert issubclass(utils.NotSupportedError, RuntimeError)
    assert inject._is_no_gpu(utils.NotSupportedError("x")) and inject._is_no_gpu(fake_cupti.NotSupportedError("x"))
    if os.path.exists("/dev/nvidiactl"):
        assert cupti.get_timestamp() > 0
    else:
        with pytest.raises(utils.NotSupportedError):
            cupti.get_timestamp()


def test_probe_with_the_real_module_says_no_gpu_here():
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has a GPU: the no-GPU answer cannot be checked here")
    p = inject.probe({"CCLD_CUPTI_FORCE": "1"})  # past the /dev check, into a real CUPTI call
    assert (p.ok, p.line) == (False, "ccld: CUPTI: no GPU, host-side timing only")


class RealRecords:
    """Builds real cupti-python record objects; keeps their backing arrays and names alive."""

    CLASSES = {"ActivityKernel13": "activity_kernel13_dtype", "ActivityAPI": "activity_api_dtype",
               "ActivityMemcpy7": "activity_memcpy7_dtype", "ActivityMemset4": "activity_memset4_dtype"}

    def __init__(self):
        self.keep = []

    def __call__(self, cls_name, fields):
        arr = np.zeros(1, dtype=getattr(cupti, self.CLASSES[cls_name]))
        for k, v in fields.items():
            if k == "name":
                buf = ctypes.create_string_buffer(v.encode())
                self.keep.append(buf)
                v = ctypes.addressof(buf)
            arr[k] = v
        self.keep.append(arr)
        return getattr(cupti, cls_name).from_data(arr)


def test_capture_reads_real_record_objects():
    fake = FakeCupti(record_factory=RealRecords())
    cap = Capture(fake, CaptureConfig(memcpy=True))
    cap.start()
    name = "_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE"
    corr = fake.launch(name, stream=13, duration_ns=777, device=1)
    fake.launch("", memop="memcpy", api="memcpy", nbytes=1 << 20, stream=13)
    fake.launch("_ZN2at6native6kernelEv")  # filtered out
    cap.flush()
    recs = cap.queue.drain()
    k = next(r for r in recs if r[0] == REC_KERNEL)
    assert (k[3], k[4], k[5], k[6], k[2] - k[1]) == (1, 13, corr, name, 777)
    a = next(r for r in recs if r[0] == REC_API and r[1] == corr)
    assert a[2] == __import__("threading").get_native_id() and a[5] == 211
    m = next(r for r in recs if r[0] == REC_MEMCPY)
    assert (m[6], m[7]) == (1 << 20, 8)
    assert cap.snapshot()["kernels_filtered"] == 1
