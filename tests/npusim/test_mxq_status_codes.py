"""Every status ``npusim.mxq`` raises is one of the real qbruntime 1.5.0 core's status strings
(issue 20 §1: five of ours were invented). The real strings below were read from the
``mobilint-qb-runtime`` 1.5.0 wheel (``strings qbruntime*.so``); facts, not code."""

from __future__ import annotations

from npusim.mxq.errors import INFERRED_STATUSES, STATUS_CODES

#: qbruntime 1.5.0's status strings (its StatusCode names).
REAL_STATUSES = frozenset("""
InternalError NotImplemented BadAlloc
Acc_AmbiguousDevice Acc_CoreAlreadyInUse Acc_DeviceNotFound Acc_NPUTimeout Acc_NoIMemInitFound
Acc_NoSuchModel Acc_TaskQueueNotFound Acc_UnknownDevice
Driver_FailedToAllocateHostMemory Driver_FailedToAllocateModelMemory Driver_FailedToBuildCmaIoReq
Driver_FailedToClaimCores Driver_FailedToFreeHostMemory Driver_FailedToFreeModelMemory
Driver_FailedToLockCore Driver_FailedToPostInfer Driver_FailedToReadMemoryBuffer
Driver_FailedToSyncMappedMemory Driver_FailedToUnclaimCores Driver_FailedToUnlockCore
Driver_FailedToWaitDone Driver_FailedToWriteMemoryBuffer Driver_NotInitialized
Driver_WaitDoneTimeout Driver_WrongBaseAddress
Model_AlreadyLaunched Model_AsyncPipelineCheckFailed Model_AsyncPipelineNotAlive
Model_AsyncPipelineTimeout Model_BrokenMXQ Model_BufferSizeMismatched Model_CacheNotFound
Model_CacheOverflow Model_DtypeMismatched Model_FailedToAllocMemory Model_FailedToFindDirectory
Model_FailedToLoadMXQ Model_FailedToOpenCacheFile Model_FailedToOpenModelDescFile
Model_FailedToOpenOutputScale Model_FailedToOpenScaleFile Model_FailedToOpenSectionBinary
Model_FailedToSaveTensor Model_InvalidBatchParam Model_InvalidNPUDtype Model_InvalidOutputScaleValue
Model_InvalidRmemType Model_InvalidScaleValue Model_InvalidSupplementary Model_InvalidVariantIdx
Model_IsNotPacked Model_IsNotSupportedHardware Model_IsPacked Model_MXQAndModelConfigNotMatch
Model_NoCache Model_NoGlobalCoreWithGlobalMultiMode Model_NoTargetCores Model_NotAlive
Model_NotLaunched Model_NotSupported Model_NumCacheMismatched Model_PredictError
Model_ShapeMismatched Model_TaskQueueClosed Model_TaskQueueTimeout Model_UnexpectedMemoryFormat
""".split())


def test_every_simulated_status_is_a_real_one():
    assert set(STATUS_CODES) <= REAL_STATUSES, sorted(set(STATUS_CODES) - REAL_STATUSES)


def test_inferred_pairings_are_raised_statuses():
    assert set(INFERRED_STATUSES) <= set(STATUS_CODES)
