"""vllm_npu.device_retry: one retry policy for every NPU worker (retry once, only on the
runtime's own device errors), and the device-error types each device names."""

from __future__ import annotations

import logging

import pytest

from vllm_npu.device_retry import DeviceRetry, first_line


class DeviceFault(RuntimeError):
    pass


class Twice(RuntimeError):
    pass


POLICY = DeviceRetry("Dev", (DeviceFault,), Twice)


def flaky(*failures: BaseException):
    """A device call raising ``failures`` in turn, then returning the number of calls."""
    calls: list[int] = []

    def fn() -> int:
        calls.append(1)
        if len(calls) <= len(failures):
            raise failures[len(calls) - 1]
        return len(calls)

    return fn, calls


def test_a_device_error_is_retried_once_and_logged(caplog):
    fn, calls = flaky(DeviceFault("NRT_FAILURE\ndetail"))
    retries: list[int] = []
    with caplog.at_level(logging.WARNING, logger="vllm.vllm_npu.dev"):
        assert POLICY.call("decode of 4 rows", fn, where=" on core 1", on_retry=lambda: retries.append(1)) == 2
    assert (len(calls), retries) == (2, [1])
    assert [r.getMessage() for r in caplog.records] == [
        "Dev decode of 4 rows failed on core 1; retrying once: NRT_FAILURE"]


def test_a_second_device_error_is_failed_twice_chained_to_it():
    second = DeviceFault("still down")
    fn, calls = flaky(DeviceFault("down"), second)
    with pytest.raises(Twice) as err:
        POLICY.call("prefill", fn, where=" on slots [(0, 1)]")
    assert str(err.value) == "Dev prefill failed twice on slots [(0, 1)]: still down"
    assert err.value.__cause__ is second and len(calls) == 2


@pytest.mark.parametrize("exc", [ValueError("shape (1, 9) is not the compiled (1, 8)"), KeyError("req"),
                                 RuntimeError("a plain bug"), TypeError("x")])
def test_any_other_error_propagates_at_once_as_itself(exc):
    """A deterministic bug must not become "the device failed twice"."""
    fn, calls = flaky(exc)
    with pytest.raises(type(exc)) as err:
        POLICY.call("decode", fn, on_retry=pytest.fail)
    assert err.value is exc and len(calls) == 1


def test_an_other_error_on_the_retry_propagates_as_itself():
    bug = ValueError("bug on the retry")
    fn, _ = flaky(DeviceFault("down"), bug)
    with pytest.raises(ValueError) as err:
        POLICY.call("decode", fn)
    assert err.value is bug


def test_never_types_are_not_retried_even_as_device_error_subclasses():
    class Recompile(DeviceFault):
        pass

    policy = DeviceRetry("Dev", (DeviceFault,), Twice, never=(Recompile,))
    fn, calls = flaky(Recompile("graph (decode, 3) was not compiled"))
    with pytest.raises(Recompile):
        policy.call("decode", fn)
    assert len(calls) == 1


def test_not_implemented_is_never_retried_by_default():
    policy = DeviceRetry("Dev", (RuntimeError,), Twice)
    fn, calls = flaky(NotImplementedError("issue 11"))
    with pytest.raises(NotImplementedError):
        policy.call("decode", fn)
    assert len(calls) == 1


def test_cause_of_classifies_the_wrapped_error():
    def innermost(exc: BaseException) -> BaseException:
        while exc.__cause__ is not None:
            exc = exc.__cause__
        return exc

    wrapped = RuntimeError("backend failed")
    wrapped.__cause__ = DeviceFault("NRT_TIMEOUT")
    policy = DeviceRetry("Dev", (DeviceFault,), Twice, cause_of=innermost)
    fn, calls = flaky(wrapped)
    assert policy.call("decode", fn) == 2
    plain = RuntimeError("backend failed")
    plain.__cause__ = ValueError("bad input")
    with pytest.raises(RuntimeError):
        policy.call("decode", flaky(plain)[0])


def test_may_retry_false_re_raises_the_first_failure():
    first = DeviceFault("during warm-up")
    fn, calls = flaky(first)
    with pytest.raises(DeviceFault) as err:
        POLICY.call("decode", fn, may_retry=lambda: False)
    assert err.value is first and len(calls) == 1


def test_first_line():
    assert first_line(RuntimeError("a\nb")) == "a" and first_line(RuntimeError()) == "RuntimeError"


# --------------------------------------------------------------------------------------------
# what each device names


def _classified(policy: DeviceRetry, *excs: BaseException) -> list[bool]:
    return [policy.is_device_error(e) for e in excs]


def test_mblt_retries_only_qbruntime_errors():
    import npusim.mxq as qb

    from vllm_npu.mblt.worker import MbltDeviceError, device_retry

    policy = device_retry(qb)
    assert policy.failed_twice is MbltDeviceError
    assert _classified(policy, qb.QbRuntimeError("InternalError"), RuntimeError("x"), ValueError("x")) == [
        True, False, False]


def test_rbln_retries_runtime_errors_but_not_bugs_or_its_own_refusals():
    from npusim.rbln.errors import RBLNInputError, RBLNRuntimeFault

    from vllm_npu.rbln.vllm_worker import VLLM_PATH_RETRY, RblnRecompileError
    from vllm_npu.rbln.worker import DEVICE_RETRY, RblnDeviceError, RblnWorkerError

    assert DEVICE_RETRY.failed_twice is RblnDeviceError
    assert _classified(DEVICE_RETRY, RBLNRuntimeFault("timed out"), RBLNInputError("shape"), ValueError("x"),
                       NotImplementedError("x"), RblnWorkerError("plan")) == [True, False, False, False, False]
    wrapped = RuntimeError("torch.compile backend failed")
    wrapped.__cause__ = RblnRecompileError("(decode, 3) was not compiled")
    fault = RuntimeError("wrapped")
    fault.__cause__ = RBLNRuntimeFault("timed out")
    assert _classified(VLLM_PATH_RETRY, wrapped, fault) == [False, True]


def test_neuron_retries_nrt_errors_not_binding_misuse():
    import npusim.neff as nrt

    from vllm_npu.neuron.errors import NeuronDeviceError
    from vllm_npu.neuron.worker import device_retry

    policy = device_retry(nrt)
    assert policy.failed_twice is NeuronDeviceError
    assert _classified(policy, nrt.NrtError("NRT_FAILURE(1)"), nrt.NrtpyError("dtype"), RuntimeError("x")) == [
        True, False, False]
