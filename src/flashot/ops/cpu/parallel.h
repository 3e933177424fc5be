// flashot CPU kernels: the thread team that runs them (no OpenMP).
//
// run_team(nth, fn) calls fn(tid) on nth threads, tid = 0 being the calling thread, and
// returns when all have finished; fn takes its work from a shared Tasks counter (dynamic
// scheduling: a thread that was descheduled by a competing process simply takes fewer
// tasks).  Why our own team instead of OpenMP (measured in benchmarks/CPU_ENGINE.md,
// "Instruction sets, denormals and load"):
//
// * Waiting.  Idle workers spin briefly (SPIN_NS) and then sleep on a condition variable,
//   and the caller waits for the last task the same way.  libgomp's default (the runtime
//   PyTorch ships and that our library shared) spins ~300k iterations at each join; beside
//   busy processes, a spinning waiter holds a core that the descheduled worker it waits for
//   needs: solves slowed 2.7-4x beside two busy processes, against 2x with passive waiting.
//   OMP_WAIT_POLICY would fix that only for the whole process (PyTorch included) and only if
//   set before torch is imported.
// * Portability.  Plain C++11 threads: the same multi-threaded build with g++, clang++ and
//   Apple clang (which has no OpenMP).
// * Re-entrancy.  One team per process; a call made while the team is busy (another Python
//   thread, or a kernel called from inside another parallel region) runs on its own calling
//   thread alone instead of oversubscribing the cores or deadlocking.
// * fork().  A child process (DataLoader workers) gets a fresh team on its first call: the
//   parent's threads do not exist there.
//
// Worker threads run nothing but fn, which opens its own FpScope (fpenv.h).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FL_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define FL_PAUSE() __asm__ __volatile__("yield")
#else
#define FL_PAUSE() std::this_thread::yield()
#endif

namespace flashot_par {

constexpr int MAX_THREADS = 256;
constexpr int64_t SPIN_NS = 50000;  // spin this long before sleeping (back-to-back kernel calls stay hot)

// Hands out task indices [0, n) in chunks, to whichever thread asks first.
class Tasks {
 public:
  explicit Tasks(int64_t n, int64_t chunk = 1) : n_(n), chunk_(std::max<int64_t>(1, chunk)) {}
  bool next(int64_t& t) {
    int64_t e;
    return next(t, e);
  }
  bool next(int64_t& b, int64_t& e) {
    const int64_t s = next_.fetch_add(chunk_, std::memory_order_relaxed);
    if (s >= n_) return false;
    b = s;
    e = std::min(n_, s + chunk_);
    return true;
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t n_, chunk_;
};

class Team {
 public:
  // fn(tid) on min(nth, MAX_THREADS) threads; the caller runs tid 0.  Returns the team size used.
  int run(int nth, const std::function<void(int)>& fn) {
    nth = std::max(1, std::min(nth, MAX_THREADS));
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (nth == 1 || !busy.owns_lock()) {  // single thread, or the team is in use: run here alone
      fn(0);
      return 1;
    }
    grow(nth - 1);
    {
      std::lock_guard<std::mutex> g(mu_);
      job_ = &fn;
      want_ = nth - 1;
      pending_.store(nth - 1, std::memory_order_relaxed);
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    fn(0);
    wait_until([&] { return pending_.load(std::memory_order_acquire) == 0; }, done_mu_, done_cv_);
    return nth;
  }

  static Team& get() {  // one per process; a forked child makes its own (the parent's threads are gone)
    static std::mutex m;
    static Team* team = nullptr;
    static pid_t owner = 0;
    std::lock_guard<std::mutex> g(m);
    if (team == nullptr || owner != getpid()) {
      team = new Team();  // never destroyed: detached workers may still wait on it at exit
      owner = getpid();
    }
    return *team;
  }

 private:
  void grow(int workers) {  // called before the job is published: new workers start from this generation
    const uint64_t now = gen_.load(std::memory_order_acquire);
    while ((int)nthreads_ < workers) {
      const int tid = (int)nthreads_ + 1;
      std::thread([this, tid, now] { worker(tid, now); }).detach();
      ++nthreads_;
    }
  }

  template <typename Pred>
  static void wait_until(Pred ready, std::mutex& mu, std::condition_variable& cv) {
    const auto t0 = std::chrono::steady_clock::now();
    while (!ready()) {
      if (std::chrono::steady_clock::now() - t0 > std::chrono::nanoseconds(SPIN_NS)) {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, ready);
        return;
      }
      for (int i = 0; i < 32; ++i) FL_PAUSE();
    }
  }

  void worker(int tid, uint64_t seen) {
    for (;;) {
      wait_until([&] { return gen_.load(std::memory_order_acquire) != seen; }, mu_, cv_);
      const std::function<void(int)>* job;
      int want;
      {
        std::lock_guard<std::mutex> g(mu_);
        seen = gen_.load(std::memory_order_acquire);
        job = job_;
        want = want_;
      }
      if (tid > want) continue;  // not part of this (smaller) team
      (*job)(tid);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> g(done_mu_);
        done_cv_.notify_one();
      }
    }
  }

  std::mutex run_mu_;  // held by the caller for the whole run: one job at a time
  std::mutex mu_, done_mu_;
  std::condition_variable cv_, done_cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int)>* job_ = nullptr;
  int want_ = 0;
  unsigned nthreads_ = 0;
};

// fn(tid) on up to nth threads (see Team::run).
inline int run_team(int nth, const std::function<void(int)>& fn) { return Team::get().run(nth, fn); }

}  // namespace flashot_par

using flashot_par::run_team;
using flashot_par::Tasks;
