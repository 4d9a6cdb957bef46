"""NCCL kernel names (both naming schemes, mangled or not) -> op / reduction / dtype / algorithm / protocol."""
import pytest

from ccld.cupti.names import NOT_NCCL, KernelName, is_nccl, parse

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name, want", [
    # NCCL >= 2.19, as CUPTI reports it (mangled) and demangled
    ("_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE",
     KernelName(True, "allreduce", "sum", "float32", "RING", "LL")),
    ("ncclDevKernel_AllReduce_Sum_bf16_TREE_LL128(ncclDevKernelArgsStorage<4096ul>)",
     KernelName(True, "allreduce", "sum", "bfloat16", "TREE", "LL128")),
    ("ncclDevKernel_ReduceScatter_PreMulSum_f16_NVLS_SIMPLE(ncclDevKernelArgsStorage<4096ul>)",
     KernelName(True, "reduce_scatter", "premulsum", "float16", "NVLS", "SIMPLE")),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
     KernelName(True, "allgather", "", "", "RING", "LL")),
    ("ncclDevKernel_AllReduce_MinMax_i64_COLLNET_DIRECT_SIMPLE(x)",
     KernelName(True, "allreduce", "minmax", "int64", "COLLNET_DIRECT", "SIMPLE")),
    ("ncclDevKernel_AllReduce_Sum_f8e4m3_NVLS_TREE_SIMPLE(x)",
     KernelName(True, "allreduce", "sum", "float8_e4m3fn", "NVLS_TREE", "SIMPLE")),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", KernelName(True, "sendrecv")),
    ("_Z21ncclDevKernel_Generic24ncclDevKernelArgsStorageILm4096EE", KernelName(True, "")),
    ("ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)", KernelName(True, "")),
    # NCCL < 2.19: algorithm and protocol first, C type names
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
     KernelName(True, "allreduce", "sum", "float32", "RING", "LL")),
    ("_Z50ncclKernel_Broadcast_RING_SIMPLE_Sum___nv_bfloat16P11ncclDevCommmP8ncclWork",
     KernelName(True, "broadcast", "sum", "bfloat16", "RING", "SIMPLE")),
    ("ncclKernel_ReduceScatter_RING_LL128_Max_half(ncclDevComm*, unsigned long, ncclWork*)",
     KernelName(True, "reduce_scatter", "max", "float16", "RING", "LL128")),
])
def test_nccl_names(name, want):
    assert parse(name) == want


def test_mangled_length_prefix_bounds_the_identifier():
    ident = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
    assert len(ident) == 39
    # "LL128" right after the identifier is the argument type's text, not the protocol
    assert parse(f"_Z39{ident}5LL128v").proto == "LL"
    assert parse(f"_Z39{ident}5LL128v").op == "allreduce"


@pytest.mark.parametrize("name", [
    "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEENS_6detail5ArrayIPcLi1EEEEEviT0_T1_",
    "ampere_sgemm_128x64_nn", "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm>(Params)", "", "x" * 5000,
])
def test_other_kernels_are_not_nccl(name):
    assert not is_nccl(name)
    assert parse(name) == NOT_NCCL


def test_nccl_helper_kernels_are_nccl_without_an_op():
    assert parse("ncclOneRankReduce_f32(float*, float const*, unsigned long)") == KernelName(True)
