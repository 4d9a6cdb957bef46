// A stand-in for PyTorch's libtorch_cuda.so where no CUDA build of torch can run (no GPU): the three
// c10d::ProcessGroupNCCL functions ccld/bpf/pgnccl.bpf.c probes, with torch's own signatures, so the
// compiler gives them torch's mangled names and torch's calling convention (hidden references for the
// std::string and intrusive_ptr arguments, a hidden return slot for initWork's intrusive_ptr, seq and
// isP2P on the stack). tests/data/libtorch_cuda_symbols.txt holds the names read off torch 2.14.1's
// libtorch_cuda.so; tests/bpf/test_pgnccl_probes.py checks this library exports exactly those.
// The bodies do what c10d does with the arguments the probes read: a group counts its collectives
// (seqCollective_) and its p2p ops (seqP2P_) apart and hands the matching one to the work it builds.
// Built by the test: g++ -shared -fPIC -O1 -o libtorch_cuda.so fake_torch_cuda.cpp
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace c10 {
struct Device {
    int8_t type;
    int8_t index;
};
namespace detail {
template <class T>
struct intrusive_target_default_null_type {};
}  // namespace detail
template <class T, class NullType = detail::intrusive_target_default_null_type<T>>
class intrusive_ptr {
  public:
    T *p = nullptr;
    intrusive_ptr() {}
    explicit intrusive_ptr(T *q) : p(q) {}
    intrusive_ptr(const intrusive_ptr &o) : p(o.p) {}  // not trivially copyable: passed by reference
    ~intrusive_ptr() {}
};
}  // namespace c10

namespace at {
class Tensor {
    void *impl_ = nullptr;
};
}  // namespace at

namespace c10d {
enum class OpType : std::uint8_t { BROADCAST = 0, ALLREDUCE = 1, ALLGATHER = 4, SEND = 12, RECV = 13, BARRIER = 15 };
enum class DebugLevel { Off = 0, Info = 1, Detail = 2 };
class Store {};

class ProcessGroupNCCL {
  public:
    struct Options {};
    class WorkNCCL {
      public:
        WorkNCCL(std::string pgUID, std::string pgDesc, c10::Device &device, int rank, OpType opType, uint64_t seq,
                 bool isP2P = false, const char *profilingTitle = nullptr,
                 const std::optional<std::vector<at::Tensor>> &inputs = std::nullopt, bool enableTiming = false,
                 bool cudaEventCacheEnabled = false, DebugLevel distDebugLevel = DebugLevel::Off);
        std::string uid_;
        uint64_t seq_;
        bool p2p_;
    };
    ProcessGroupNCCL(c10::intrusive_ptr<Store> store, int rank, int size, c10::intrusive_ptr<Options> options);
    c10::intrusive_ptr<WorkNCCL> initWork(c10::Device &device, int rank, OpType opType, bool isP2P,
                                          const char *profilingTitle, const std::vector<at::Tensor> &inputs,
                                          const std::vector<at::Tensor> &outputs, bool record);
    std::string pg_uid_;
    int rank_, size_;
    uint64_t seqCollective_ = 0, seqP2P_ = 0;
};

__attribute__((noinline)) ProcessGroupNCCL::WorkNCCL::WorkNCCL(
        std::string pgUID, std::string pgDesc, c10::Device &device, int rank, OpType opType, uint64_t seq,
        bool isP2P, const char *profilingTitle, const std::optional<std::vector<at::Tensor>> &inputs,
        bool enableTiming, bool cudaEventCacheEnabled, DebugLevel distDebugLevel)
    : uid_(pgUID), seq_(seq), p2p_(isP2P)
{
    asm volatile("" ::: "memory");
}

__attribute__((noinline)) ProcessGroupNCCL::ProcessGroupNCCL(c10::intrusive_ptr<Store> store, int rank, int size,
                                                              c10::intrusive_ptr<Options> options)
    : rank_(rank), size_(size)
{
    asm volatile("" ::: "memory");
}

__attribute__((noinline)) c10::intrusive_ptr<ProcessGroupNCCL::WorkNCCL> ProcessGroupNCCL::initWork(
        c10::Device &device, int rank, OpType opType, bool isP2P, const char *profilingTitle,
        const std::vector<at::Tensor> &inputs, const std::vector<at::Tensor> &outputs, bool record)
{
    return c10::intrusive_ptr<WorkNCCL>(
        new WorkNCCL(pg_uid_, "desc", device, rank, opType, isP2P ? seqP2P_ : seqCollective_, isP2P));
}
}  // namespace c10d

// What the workload calls through ctypes (tests/workloads/pgnccl_calls.py): torch's Python API would.
extern "C" void *fake_pg_new(const char *uid, int rank, int size)
{
    c10::intrusive_ptr<c10d::Store> store;
    c10::intrusive_ptr<c10d::ProcessGroupNCCL::Options> options;
    auto *pg = new c10d::ProcessGroupNCCL(store, rank, size, options);
    pg->pg_uid_ = uid;  // torch sets pg_uid_ from the options' group name in the constructor
    return pg;
}

// One op of group `pg`: c10d's collective() / pointToPoint() count it, then build its work.
extern "C" uint64_t fake_op(void *p, int op, int p2p)
{
    auto *pg = static_cast<c10d::ProcessGroupNCCL *>(p);
    if (p2p)
        pg->seqP2P_++;
    else
        pg->seqCollective_++;
    c10::Device dev{1, 0};
    std::vector<at::Tensor> none;
    auto w = pg->initWork(dev, pg->rank_, static_cast<c10d::OpType>(op), p2p != 0, "nccl:op", none, none, true);
    uint64_t seq = w.p->seq_;
    delete w.p;
    return seq;
}
