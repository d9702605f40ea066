// The all-reduce of a tensor-parallel group whose ranks share one host's memory: each rank copies
// its partial sum into its slot of a shared region, raises its flag, waits for every other rank's,
// and adds the slots up in rank order (so every rank holds the same bits).
//
// Why: gloo's all-reduce over loopback TCP took 0.4-1.5 ms for a decode step's [16, 576] on two
// ranks (threads, syscalls, wake-ups), 61 of them a step of the embedded model: more than the
// step's own compute. Here it is two memory copies and a spin on a cache line.
//
// The region (a file of /dev/shm mapped by every rank, `workers/tp.py`): one 64-byte line per
// rank for its flag, then two phases of one slot per rank of `capacity` bytes. Call `seq` (1, 2,
// ...) writes phase seq % 2: a rank rewrites its slot of a phase at seq + 2 only after every rank
// raised its flag to seq + 1, by which time each has read all of call seq's slots.
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cerrno>
#include <sched.h>
#include <signal.h>

#include "common.h"
#include "kernels.h"

static constexpr int64_t kLine = 64;

// whether process `pid` has ended: gone, or a zombie its parent has not reaped yet (Linux's /proc)
static bool ended(pid_t pid) {
    if (kill(pid, 0) == -1 && errno == ESRCH) return true;
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%d/stat", int(pid));
    std::FILE* f = std::fopen(path, "r");
    if (f == nullptr) return false;
    char line[512] = {0};
    const size_t n = std::fread(line, 1, sizeof line - 1, f);
    std::fclose(f);
    const char* paren = std::strrchr(line, ')');  // "pid (name) state ..."
    return n > 0 && paren != nullptr && (paren[2] == 'Z' || paren[2] == 'X');
}

static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

template <typename T>
static void add_slots(T* x, const uint8_t* slots, int64_t capacity, int64_t size, int64_t n) {
    at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            float sum = 0.f;
            for (int64_t r = 0; r < size; ++r)
                sum += load(reinterpret_cast<const T*>(slots + r * capacity), i);
            store(x, i, sum);
        }
    });
}

void shm_all_reduce(torch::Tensor x, torch::Tensor region, torch::Tensor pids, int64_t rank,
                    int64_t seq, double timeout_s) {
    const int64_t size = pids.numel();
    TORCH_CHECK(x.is_contiguous() && region.is_contiguous(), "shm_all_reduce: contiguous tensors");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16,
                "shm_all_reduce: fp32 or bf16");
    uint8_t* base = ptr<uint8_t>(region);
    const int64_t header = size * kLine;
    const int64_t capacity = (region.numel() - header) / (2 * size);
    const int64_t bytes = x.numel() * x.element_size();
    TORCH_CHECK(bytes <= capacity, "shm_all_reduce: ", bytes, " bytes, slots of ", capacity);
    uint8_t* slots = base + header + (seq % 2) * size * capacity;
    std::memcpy(slots + rank * capacity, x.data_ptr(), bytes);
    __atomic_store_n(reinterpret_cast<int64_t*>(base + rank * kLine), seq, __ATOMIC_RELEASE);
    const auto start = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < size; ++r) {
        const int64_t* flag = reinterpret_cast<const int64_t*>(base + r * kLine);
        for (int64_t spins = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < seq; ++spins) {
            if (spins < 4096) {
                cpu_relax();
                continue;
            }
            sched_yield();  // more ranks than cores, or a slow peer: let it run
            if (spins % 65536 != 0) continue;
            // a rank that died raises no flag: say so rather than wait (gloo's socket would close)
            const pid_t pid = pid_t(ptr<int64_t>(pids)[r]);
            TORCH_CHECK(!ended(pid), "shm_all_reduce: rank ", r, " (pid ", pid, ") is gone");
            const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
            TORCH_CHECK(waited.count() < timeout_s, "shm_all_reduce: rank ", r,
                        " did not answer in ", timeout_s, " s");
        }
    }
    if (x.scalar_type() == torch::kFloat32)
        add_slots(ptr<float>(x), slots, capacity, size, x.numel());
    else
        add_slots(ptr<uint16_t>(x), slots, capacity, size, x.numel());
}
