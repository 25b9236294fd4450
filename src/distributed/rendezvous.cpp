#include "rendezvous.h"

#include <arpa/inet.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "error_message.h"
#include "hyperparallel/launch_env.h"

namespace hp::detail {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

Deadline Deadline::after(milliseconds timeout) { return {Clock::now() + timeout, timeout}; }

milliseconds Deadline::remaining() const {
  return std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(at - Clock::now()));
}

namespace {

// The extra time the last store requests may take past the deadline before the store
// counts as lost.
constexpr milliseconds kGrace{2000};

// How long the rank that decides a failed join waits for the others to take its verdict:
// ranks start up to this much apart and still all name the missing ranks.
constexpr milliseconds kLinger{2000};

// How long a rank whose collective failed waits for the group's other members to say
// theirs failed too, before naming those that did not; and the extra time its store calls
// may take before the store counts as lost.
constexpr milliseconds kReportWindow{2000};
constexpr milliseconds kReportGrace{1000};

// Who hosts the store, for messages: hp-run and torchrun host it themselves, a job started
// otherwise has it on rank 0.
constexpr const char* kStoreHost =
    "the process that hosts the store (hp-run, torchrun's agent, or else rank 0)";

constexpr const char* kRaiseTimeout =
    "raise the timeout (HP_TIMEOUT_S=<seconds>, or WorldOptions::timeout) if ranks start slowly";

std::string seconds_text(milliseconds t) {
  char text[32];
  std::snprintf(text, sizeof text, "%g s", static_cast<double>(t.count()) / 1000.0);
  return text;
}

std::string store_address(const LaunchEnv& env) {
  return "MASTER_ADDR=" + env.master_addr + " MASTER_PORT=" + std::to_string(env.master_port);
}

// "rank 3", or "ranks 1, 2, 5" (the first 16, then how many more).
std::string ranks_text(const std::vector<int64_t>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  constexpr size_t kShown = 16;
  for (size_t i = 0; i < std::min(ranks.size(), kShown); ++i) {
    text += (i > 0 ? ", " : "") + std::to_string(ranks[i]);
  }
  if (ranks.size() > kShown) text += " and " + std::to_string(ranks.size() - kShown) + " more";
  return text;
}

// A list of ranks as store bytes ("1,5,7") and back.
std::vector<uint8_t> encode_ranks(const std::vector<int64_t>& ranks) {
  std::string text;
  for (int64_t r : ranks) {
    if (!text.empty()) text += ',';
    text += std::to_string(r);
  }
  return {text.begin(), text.end()};
}

std::vector<int64_t> decode_ranks(const std::vector<uint8_t>& bytes) {
  std::vector<int64_t> ranks;
  const std::string text(bytes.begin(), bytes.end());
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = std::min(text.find(',', begin), text.size());
    ranks.push_back(std::stoll(text.substr(begin, end - begin)));
    begin = end + 1;
  }
  return ranks;
}

// Ranks started with settings that do not fit together (WORLD_SIZE, RANK): reported as
// such, not as ranks missing or a store lost.
struct LaunchMismatch : c10::DistNetworkError {
  using c10::DistNetworkError::DistNetworkError;
};

// The deadline of finish_by passed: its own report, not one to wrap in another.
struct DeadlinePassed : c10::DistNetworkError {
  using c10::DistNetworkError::DistNetworkError;
};

// What a rank stores on arriving: the size of the group it expects and a number of this
// arrival's own, which tells two processes with the same RANK apart.
std::string arrival_record(size_t group_size) {
  std::random_device random;
  const uint64_t nonce = (static_cast<uint64_t>(random()) << 32) ^ random() ^ getpid();
  return std::to_string(group_size) + " " + std::to_string(nonce);
}

size_t group_size_of(const std::vector<uint8_t>& record) {
  return std::stoull(std::string(record.begin(), record.end()));
}

// The first rank of `ranks` whose arrival is in `records` (by position; empty: not
// arrived) expects a group of another size than this rank does: that rank and its size.
std::optional<std::pair<int64_t, size_t>> other_group_size(
    const std::vector<std::vector<uint8_t>>& records, const std::vector<int64_t>& ranks) {
  for (size_t i = 0; i < records.size(); ++i) {
    if (!records[i].empty() && group_size_of(records[i]) != ranks.size()) {
      return std::make_pair(ranks[i], group_size_of(records[i]));
    }
  }
  return std::nullopt;
}

std::string group_size_mismatch(const std::string& operation, int64_t other, size_t other_size,
                                int64_t rank, size_t size) {
  return operation + ": rank " + std::to_string(other) + " expects a group of " +
         std::to_string(other_size) + " ranks, this rank (" + std::to_string(rank) + ") one of " +
         std::to_string(size) + ": start every rank with the same WORLD_SIZE";
}

// The first failed collective this process reported on the group `key_prefix` of `store`
// (its id and description), recording `id` and `what` when it is the first. The entry holds
// the store, so that no other group's store can take its address.
std::pair<std::string, std::string> first_failure_of(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::string& key_prefix,
                                                     const std::string& id,
                                                     const std::string& what) {
  using Key = std::pair<const c10d::Store*, std::string>;
  struct First {
    c10::intrusive_ptr<c10d::Store> store;
    std::pair<std::string, std::string> failure;
  };
  static auto* const mutex = new std::mutex;
  static auto* const firsts = new std::map<Key, First>;
  std::lock_guard lock(*mutex);
  const auto entry =
      firsts->try_emplace(Key{store.get(), key_prefix}, First{store, {id, what}}).first;
  return entry->second.failure;
}

// Where a failed collective's report ends, for every rank of the world: "failing" (the
// collective, set when the report starts) and "absent" (the members that did not report
// it, set when its window ends). A member that did not report a collective but is failing
// in another one is alive: blocked behind the ranks it found absent there.
std::string failing_key(int64_t rank) { return "hp/faults/failing/" + std::to_string(rank); }
std::string absent_key(int64_t rank) { return "hp/faults/absent/" + std::to_string(rank); }

struct Blame {
  std::vector<int64_t> absent;  // the ranks to name: stopped, crashed, or hung
  // The members that did not reach the collective because they failed in another one:
  // that collective and the ranks it found absent ("ranks 2, 5"; empty: none).
  std::map<int64_t, std::pair<std::string, std::string>> blocked;
};

// Follows `absent` (the members of this rank's failed collective that did not report it)
// to the ranks that hold them up: a member failing in another collective is replaced by the
// members absent from that one, as far as their reports reach by `until`.
Blame follow_blame(const c10::intrusive_ptr<c10d::Store>& store, int64_t rank,
                   std::vector<int64_t> absent, Clock::time_point until) {
  Blame blame;
  std::vector<int64_t> visited{rank};
  while (!absent.empty()) {
    const int64_t r = absent.front();
    absent.erase(absent.begin());
    if (std::count(visited.begin(), visited.end(), r) > 0) continue;
    visited.push_back(r);
    if (!store->check({failing_key(r)})) {
      blame.absent.push_back(r);
      continue;
    }
    // Failing too: its window ends within kReportWindow of its start.
    while (!store->check({absent_key(r)}) && Clock::now() < until) {
      std::this_thread::sleep_for(milliseconds(20));
    }
    if (!store->check({absent_key(r)})) {
      blame.absent.push_back(r);
      continue;
    }
    const std::vector<uint8_t> where = store->get(failing_key(r));
    const std::vector<int64_t> theirs = decode_ranks(store->get(absent_key(r)));
    blame.blocked[r] = {std::string(where.begin(), where.end()),
                        theirs.empty() ? "" : ranks_text(theirs)};
    absent.insert(absent.end(), theirs.begin(), theirs.end());
  }
  std::sort(blame.absent.begin(), blame.absent.end());
  return blame;
}

// Runs `work` on a thread of its own and returns its result, or throws
// DeadlinePassed(late()) when `at` passes first. For calls that have no deadline of
// their own: name resolution, and a TCPStore client facing a listener that accepts but
// never answers. A late thread is left behind, holding only what `work` captured by value;
// the caller is about to fail anyway.
template <typename T>
T finish_by(Clock::time_point at, std::function<T()> work,
            const std::function<std::string()>& late) {
  struct Outcome {
    std::mutex mutex;
    std::condition_variable finished;
    bool done = false;
    std::optional<T> value;
    std::exception_ptr error;
  };
  auto outcome = std::make_shared<Outcome>();
  std::thread([outcome, work = std::move(work)] {
    std::optional<T> value;
    std::exception_ptr error;
    try {
      value.emplace(work());
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard lock(outcome->mutex);
    outcome->value = std::move(value);
    outcome->error = error;
    outcome->done = true;
    outcome->finished.notify_all();
  }).detach();
  std::unique_lock lock(outcome->mutex);
  if (!outcome->finished.wait_until(lock, at, [&] { return outcome->done; })) {
    throw named_failure<DeadlinePassed>(late());
  }
  if (outcome->error) std::rethrow_exception(outcome->error);
  return std::move(*outcome->value);
}

// MASTER_ADDR's IPv4 address, in dotted form.
std::string resolve_master(const LaunchEnv& env, const Deadline& deadline) {
  const std::string name = env.master_addr;
  return finish_by<std::string>(
      deadline.at,
      [name] {
        addrinfo hints{};
        hints.ai_family = AF_INET;
        hints.ai_socktype = SOCK_STREAM;
        addrinfo* found = nullptr;
        const int status = getaddrinfo(name.c_str(), nullptr, &hints, &found);
        if (status != 0 || found == nullptr) {
          throw named_failure<c10::ValueError>(
              "MASTER_ADDR='" + name + "' does not resolve to an IPv4 address (" +
              gai_strerror(status) +
              "); set MASTER_ADDR to an address or a resolvable host "
              "name of the rank-0 machine");
        }
        char text[INET_ADDRSTRLEN] = {};
        inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr, text,
                  sizeof text);
        freeaddrinfo(found);
        return std::string(text);
      },
      [&] {
        return "MASTER_ADDR='" + name + "' did not resolve within " +
               seconds_text(deadline.timeout) +
               " (the name service does not answer); set MASTER_ADDR to an address, or " +
               kRaiseTimeout;
      });
}

sockaddr_in ipv4(const std::string& address, int port) {
  sockaddr_in socket_address{};
  socket_address.sin_family = AF_INET;
  socket_address.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, address.c_str(), &socket_address.sin_addr);
  return socket_address;
}

// The local address this rank uses to reach the master: the kernel's route choice for
// a UDP "connection" (no packet is sent). Gloo must listen on an address the other
// ranks can reach, and the machine's hostname may not resolve.
std::string local_address_towards(const std::string& master, int port) {
  const sockaddr_in target = ipv4(master, port);
  const int fd = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in local{};
  socklen_t length = sizeof local;
  const bool ok = fd >= 0 &&
                  connect(fd, reinterpret_cast<const sockaddr*>(&target), sizeof target) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
  if (fd >= 0) close(fd);
  if (!ok) throw named_failure<c10::DistNetworkError>("no network route to MASTER_ADDR=" + master);
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &local.sin_addr, text, sizeof text);
  return text;
}

// Rank 0 is about to host the store: a port held by another program is named now, before
// the other ranks wait for a store that will never be.
void check_port_free(const LaunchEnv& env) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return;  // the store's own bind reports it
  const int on = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  const sockaddr_in any = ipv4("0.0.0.0", env.master_port);
  const bool in_use =
      bind(fd, reinterpret_cast<const sockaddr*>(&any), sizeof any) != 0 && errno == EADDRINUSE;
  close(fd);
  if (in_use) {
    throw named_failure<c10::DistNetworkError>(
        "rank 0 cannot host the store: MASTER_PORT=" + std::to_string(env.master_port) +
        " is already in use on this machine (another program, or a run still going); pick a "
        "free MASTER_PORT (hp-run picks one itself; under torchrun its agent hosts the store "
        "and sets TORCHELASTIC_USE_AGENT_STORE=True)");
  }
}

// Whether something accepts TCP connections at address:port within half a second.
bool accepts_connections(const std::string& address, int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  const sockaddr_in target = ipv4(address, port);
  bool connected = connect(fd, reinterpret_cast<const sockaddr*>(&target), sizeof target) == 0;
  if (!connected && errno == EINPROGRESS) {
    pollfd writable{fd, POLLOUT, 0};
    int error = 0;
    socklen_t length = sizeof error;
    connected = poll(&writable, 1, 500) == 1 &&
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0;
  }
  close(fd);
  return connected;
}

// Why no store answered at MASTER_ADDR:MASTER_PORT; `detail`: what the client said, if
// it said anything.
std::string unreachable_store(const LaunchEnv& env, const std::string& address,
                              const Deadline& deadline, const std::string& detail) {
  const std::string host = env.agent_store ? "torchrun's agent" : "rank 0";
  if (!accepts_connections(address, env.master_port)) {
    return "start-up join: " + (env.agent_store ? host + " is gone" : "rank 0 did not arrive") +
           " within " + seconds_text(deadline.timeout) + ": nothing accepts connections at " +
           store_address(env) + ", where " + host +
           " hosts the store. Start every rank with the same MASTER_ADDR, MASTER_PORT and "
           "WORLD_SIZE, or " +
           kRaiseTimeout;
  }
  return "start-up join: the program listening at " + store_address(env) +
         " did not answer as a TCPStore within " + seconds_text(deadline.timeout) +
         (detail.empty() ? "" : " (" + detail + ")") +
         ": another program holds MASTER_PORT; pick a free port (hp-run picks one itself)";
}

}  // namespace

StoreConnection connect_store(const LaunchEnv& env, const Deadline& deadline) {
  const std::string address = resolve_master(env, deadline);
  const bool host = env.rank == 0 && !env.agent_store;
  if (host) check_port_free(env);
  c10d::TCPStoreOptions options;
  options.port = static_cast<uint16_t>(env.master_port);
  options.isServer = host;
  options.numWorkers = static_cast<size_t>(env.world_size);
  options.waitWorkers = false;  // await_ranks does that, and names who is missing
  // How long the client retries connecting; longer than the deadline below, which ends
  // the wait, so that LibTorch's own timeout report (logged with a C++ backtrace) does
  // not come out of the abandoned attempt while this process reports its own error.
  options.timeout = 2 * deadline.timeout + kGrace;
  options.useLibUV = false;  // this LibTorch is built without libuv
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = finish_by<c10::intrusive_ptr<c10d::Store>>(
        deadline.at,
        [address, options, timeout = deadline.timeout]() -> c10::intrusive_ptr<c10d::Store> {
          auto tcp_store = c10::make_intrusive<c10d::TCPStore>(address, options);
          // A first request that needs an answer: a program that is not a TCPStore shows
          // itself here (no answer, or a wrong one).
          tcp_store->check({"hp/store-answers"});
          tcp_store->setTimeout(timeout);  // for the waits of the groups' rendezvous
          return tcp_store;
        },
        [&] { return unreachable_store(env, address, deadline, ""); });
  } catch (const DeadlinePassed&) {
    throw;
  } catch (const c10::Error& error) {
    if (host) {
      throw named_failure<c10::DistNetworkError>(
          "rank 0 cannot host the store on MASTER_PORT=" + std::to_string(env.master_port) + ": " +
          error.what_without_backtrace());
    }
    throw named_failure<c10::DistNetworkError>(
        unreachable_store(env, address, deadline, error.what_without_backtrace()));
  }
  if (env.agent_store) {
    // The agent's store outlives a failed attempt; a restarted one must not see its keys.
    store = c10::make_intrusive<c10d::PrefixStore>(
        "hp/attempt_" + std::to_string(env.restart_count), store);
  }
  return {store, local_address_towards(address, env.master_port)};
}

void await_ranks(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key_prefix,
                 const std::string& operation, const std::vector<int64_t>& ranks, int64_t rank,
                 const Deadline& deadline) {
  std::vector<std::string> keys;
  for (int64_t r : ranks) keys.push_back(key_prefix + "/arrived/" + std::to_string(r));
  const std::string own_key = key_prefix + "/arrived/" + std::to_string(rank);
  // The lowest rank decides a failed join for all, so every rank names the same missing
  // ranks; it keeps answering until the others have taken its verdict, since it may host
  // the store and its exit would leave them only "connection lost".
  const std::string verdict_key = key_prefix + "/verdict";
  const std::string taken_prefix = key_prefix + "/verdict_taken/";
  // Marks ranks that two processes arrived as, for the others' message.
  const std::string duplicate_prefix = key_prefix + "/duplicate/";
  // A rank that finds another expecting a group of another size (WORLD_SIZE) says so here
  // ("R N S M": rank R expects N ranks, rank S M) for the ranks whose join cannot complete
  // (they wait for ranks that do not exist), and waits for them to take it: it may host
  // the store.
  const std::string mismatch_key = key_prefix + "/size_mismatch";
  const std::string mismatch_taken_prefix = key_prefix + "/size_mismatch_taken/";
  const bool decider = rank == *std::min_element(ranks.begin(), ranks.end());
  const Clock::time_point until = deadline.at;
  // The ranks still missing when the deadline passed; empty: all arrived. Polled (every
  // 10 ms at first, backing off to 200 ms), not a store wait: a wait that times out has
  // LibTorch log warnings, and the missing ranks are listed from the same checks.
  const std::vector<int64_t> missing = finish_by<std::vector<int64_t>>(
      until + kLinger + kGrace,
      [=]() -> std::vector<int64_t> {
        try {
          const std::string record = arrival_record(ranks.size());
          const std::vector<uint8_t> mine(record.begin(), record.end());
          if (store->compareSet(own_key, {}, mine) != mine) {
            store->set(duplicate_prefix + std::to_string(rank), std::vector<uint8_t>{1});
            throw LaunchMismatch(operation + ": another process arrived as rank " +
                                 std::to_string(rank) +
                                 " before this one: start each process with a RANK of its own "
                                 "(0 to WORLD_SIZE - 1)");
          }
          const auto arrived_records = [&] {
            std::vector<std::vector<uint8_t>> records;
            for (const std::string& key : keys) {
              records.push_back(store->check({key}) ? store->get(key) : std::vector<uint8_t>{});
            }
            return records;
          };
          // Tells every rank of a group size mismatch found here, then throws it.
          const auto mismatch = [&](int64_t other, size_t other_size) {
            const std::string text = std::to_string(rank) + " " + std::to_string(ranks.size()) +
                                     " " + std::to_string(other) + " " + std::to_string(other_size);
            store->compareSet(mismatch_key, {}, std::vector<uint8_t>(text.begin(), text.end()));
            const std::vector<std::string> taker{mismatch_taken_prefix + std::to_string(other)};
            const Clock::time_point linger_end = Clock::now() + kLinger;
            while (!store->check(taker) && Clock::now() < linger_end) {
              std::this_thread::sleep_for(milliseconds(20));
            }
            throw LaunchMismatch(
                group_size_mismatch(operation, other, other_size, rank, ranks.size()));
          };
          std::optional<std::vector<int64_t>> verdict;
          for (milliseconds pause(10);; pause = std::min(2 * pause, milliseconds(200))) {
            if (store->check({mismatch_key})) {  // found by another rank
              const std::vector<uint8_t> bytes = store->get(mismatch_key);
              std::istringstream text(std::string(bytes.begin(), bytes.end()));
              int64_t finder = 0, other = 0;
              size_t finder_size = 0, other_size = 0;
              text >> finder >> finder_size >> other >> other_size;
              store->set(mismatch_taken_prefix + std::to_string(rank), std::vector<uint8_t>{1});
              if (other_size == ranks.size()) {  // this rank is the odd one: name the finder
                other = finder;
                other_size = finder_size;
              }
              if (other_size != ranks.size()) {
                throw LaunchMismatch(
                    group_size_mismatch(operation, other, other_size, rank, ranks.size()));
              }
            }
            if (!decider && store->check({verdict_key})) {
              verdict = decode_ranks(store->get(verdict_key));
              // Arrived after the decider gave up: nobody keeps the store up for it.
              if (std::count(verdict->begin(), verdict->end(), rank) > 0) return *verdict;
            } else if (store->check(keys)) {
              if (const auto other = other_group_size(store->multiGet(keys), ranks)) {
                mismatch(other->first, other->second);
              }
              return {};
            }
            if (Clock::now() >= until) break;
            std::this_thread::sleep_for(
                std::min(pause, std::chrono::duration_cast<milliseconds>(until - Clock::now())));
          }
          std::vector<int64_t> absent;
          if (verdict) {
            absent = *verdict;
          } else if (!decider && store->check({verdict_key})) {
            absent = decode_ranks(store->get(verdict_key));
          } else {
            const std::vector<std::vector<uint8_t>> records = arrived_records();
            if (const auto other = other_group_size(records, ranks)) {
              mismatch(other->first, other->second);
            }
            for (size_t i = 0; i < keys.size(); ++i) {
              if (records[i].empty()) absent.push_back(ranks[i]);
            }
          }
          if (absent.empty()) return absent;
          if (!decider) {
            store->set(taken_prefix + std::to_string(rank), std::vector<uint8_t>{1});
            return absent;
          }
          store->set(verdict_key, encode_ranks(absent));
          std::vector<std::string> takers;
          for (int64_t r : ranks) {
            if (r != rank && std::count(absent.begin(), absent.end(), r) == 0) {
              takers.push_back(taken_prefix + std::to_string(r));
            }
          }
          const Clock::time_point linger_end = Clock::now() + kLinger;
          while (!takers.empty() && !store->check(takers) && Clock::now() < linger_end) {
            std::this_thread::sleep_for(milliseconds(20));
          }
          return absent;
        } catch (const LaunchMismatch&) {
          throw;
        } catch (const std::exception& error) {
          throw named_failure<c10::DistNetworkError>(
              operation + ": lost the connection to the store (" + message_of(error) +
              "): " + kStoreHost + " has exited, or this machine is cut off from it");
        }
      },
      [&] {
        return operation + ": the store did not answer within " +
               seconds_text(deadline.timeout + kLinger + kGrace) + ": " + kStoreHost +
               " is stopped, or this machine is cut off from it";
      });
  if (missing.empty()) return;
  std::vector<int64_t> duplicated;
  try {
    duplicated = finish_by<std::vector<int64_t>>(
        Clock::now() + kReportGrace,
        [=] {
          std::vector<int64_t> found;
          for (int64_t r : ranks) {
            if (store->check({duplicate_prefix + std::to_string(r)})) found.push_back(r);
          }
          return found;
        },
        [] { return std::string("the store did not answer"); });
  } catch (const std::exception&) {  // the missing ranks are the news; this is a detail
  }
  throw named_failure<c10::DistNetworkError>(
      operation + " timed out after " + seconds_text(deadline.timeout) + ": " +
      ranks_text(missing) + " of " + std::to_string(ranks.size()) + " did not arrive" +
      (duplicated.empty() ? "" : " (and two processes arrived as " + ranks_text(duplicated) + ")") +
      ". Start every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE and a RANK of "
      "its own, or " +
      kRaiseTimeout);
}

void bounded_by_store(const std::string& operation, const Deadline& deadline,
                      std::function<void()> work) {
  finish_by<bool>(
      deadline.at + kGrace,
      [work = std::move(work)] {
        work();
        return true;
      },
      [&] {
        return operation + ": the store did not answer within " +
               seconds_text(deadline.timeout + kGrace) + ": " + kStoreHost +
               " is stopped, or this machine is cut off from it";
      });
}

void leave_after_all(const c10::intrusive_ptr<c10d::Store>& store, const std::string& key_prefix,
                     const std::string& operation, const std::vector<int64_t>& ranks, int64_t rank,
                     const Deadline& deadline) {
  const std::string done_prefix = key_prefix + "/done/";
  if (rank != *std::min_element(ranks.begin(), ranks.end())) {
    bounded_by_store(operation, deadline, [store, key = done_prefix + std::to_string(rank)] {
      store->set(key, std::vector<uint8_t>{1});
    });
    return;
  }
  std::vector<int64_t> others;
  std::vector<std::string> keys;
  for (int64_t r : ranks) {
    if (r == rank) continue;
    others.push_back(r);
    keys.push_back(done_prefix + std::to_string(r));
  }
  auto missing = std::make_shared<std::vector<int64_t>>();
  bounded_by_store(operation, deadline, [=] {
    for (milliseconds pause(1);; pause = std::min(2 * pause, milliseconds(50))) {
      if (store->check(keys)) return;
      if (Clock::now() >= deadline.at) break;
      std::this_thread::sleep_for(pause);
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!store->check({keys[i]})) missing->push_back(others[i]);
    }
  });
  if (!missing->empty()) {
    throw named_failure<c10::DistNetworkError>(
        operation + " timed out after " + seconds_text(deadline.timeout) + ": " +
        ranks_text(*missing) + " did not finish it (crashed, or stopped); " + kRaiseTimeout);
  }
}

std::string explain_failed_collective(const c10::intrusive_ptr<c10d::Store>& store,
                                      const std::string& key_prefix,
                                      const std::vector<int64_t>& ranks, int64_t rank,
                                      const std::string& what, const std::string& error,
                                      const std::string& id_or_empty) {
  const std::string& id = id_or_empty.empty() ? what : id_or_empty;
  const std::string failed = what + " failed (" + error + ")";
  const std::string advice =
      ". The wait for other ranks is HP_TIMEOUT_S (or WorldOptions::timeout, the trainer's "
      "--timeout); a rank killed or crashed takes the others down at once";
  if (!store) return failed + advice;
  // One fault, one report: after a group's first failed collective its others (a prefetch
  // given up on while the error is handled) fail with it, without a report window each.
  if (const auto first = first_failure_of(store, key_prefix, id, what); first.first != id) {
    return failed + "; after " + first.second + " failed (reported there)" + advice;
  }
  // Every member's failure of this collective, keyed by the collective's id.
  const std::string report_prefix = key_prefix + "/failed/" + id + "/";
  std::vector<std::string> keys;
  for (int64_t r : ranks) keys.push_back(report_prefix + std::to_string(r));
  // The store calls are bounded too: a stopped store host, or a network cut between this
  // machine and it, leaves a store request without an answer for as long as TCP retries.
  std::vector<int64_t> absent;
  bool late = false;
  try {
    absent = finish_by<std::vector<int64_t>>(
        Clock::now() + kReportWindow + kReportGrace,
        [=] {
          store->set(failing_key(rank), std::vector<uint8_t>(what.begin(), what.end()));
          store->set(report_prefix + std::to_string(rank), std::vector<uint8_t>{1});
          const Clock::time_point until = Clock::now() + kReportWindow;
          while (!store->check(keys) && Clock::now() < until) {
            std::this_thread::sleep_for(milliseconds(20));
          }
          std::vector<int64_t> missing;
          for (size_t i = 0; i < keys.size(); ++i) {
            if (!store->check({keys[i]})) missing.push_back(ranks[i]);
          }
          store->set(absent_key(rank), encode_ranks(missing));
          return missing;
        },
        [&] {
          late = true;
          return "the store did not answer within " + seconds_text(kReportWindow + kReportGrace) +
                 ": " + kStoreHost + " is stopped, or this machine is cut off from it";
        });
  } catch (const std::exception& store_error) {
    if (late) return failed + "; " + message_of(store_error) + advice;
    return failed + "; the store is unreachable too (" + message_of(store_error) +
           "): " + kStoreHost + " has exited, or this machine is cut off from it" + advice;
  }
  // Absent members that failed elsewhere are followed to the ranks they waited for, as far
  // as their reports come within another window; else they are named themselves.
  Blame blame{absent, {}};
  if (!absent.empty()) {
    try {
      blame = finish_by<Blame>(
          Clock::now() + kReportWindow + kReportGrace,
          [=] { return follow_blame(store, rank, absent, Clock::now() + kReportWindow); },
          [] { return std::string("the store did not answer"); });
    } catch (const std::exception&) {  // the absent members are the news; this is a detail
    }
  }
  std::string elsewhere;
  for (const auto& [blocked, where] : blame.blocked) {
    elsewhere += "; world rank " + std::to_string(blocked) + " did not reach it: it failed in " +
                 where.first + (where.second.empty() ? "" : ", waiting for world " + where.second);
  }
  if (blame.absent.empty()) {
    return failed + (blame.blocked.empty() ? "; every rank of the group saw it fail" : elsewhere) +
           advice;
  }
  return failed + "; world " + ranks_text(blame.absent) +
         " did not report the same failure within " + seconds_text(kReportWindow) +
         ": stopped, crashed, or blocked elsewhere (hung, or still computing)" + elsewhere + advice;
}

}  // namespace hp::detail
