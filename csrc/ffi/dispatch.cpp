#include "ffi/dispatch.h"

#include <charconv>

namespace flashjax {
namespace {

int family_min_sm(std::string_view family) {
  // Families are named by the arch they are written for; every later arch runs them too (sm80's mma.sync).
  int sm = 0;
  std::from_chars(family.data() + 2, family.data() + family.size(), sm);
  return sm;
}

const char* dtype_name(DType dtype) { return dtype == DType::kFloat16 ? "fp16" : "bf16"; }
const char* direction_name(Direction d) {
  return d == Direction::kFwd       ? "forward"
         : d == Direction::kBwd     ? "backward"
         : d == Direction::kTangent ? "tangent"
                                    : "fused jvp";
}

// Bytes as KB (1024 bytes), with one decimal where it is not whole: "160 KB", "99 KB", "47.5 KB".
std::string kb(int64_t bytes) {
  const int64_t tenths = (bytes * 10 + 512) / 1024;
  std::string text = std::to_string(tenths / 10);
  if (tenths % 10 != 0) text += "." + std::to_string(tenths % 10);
  return text + " KB";
}

}  // namespace

bool arch_runs_on(std::string_view compiled_arch, int device_sm) {
  // CMake spellings: "90a-real" is SASS only; "80-virtual" is PTX only, which the driver compiles for any later
  // device; a bare "80" carries both.
  bool ptx = true;
  if (const size_t dash = compiled_arch.find('-'); dash != std::string_view::npos) {
    const std::string_view kind = compiled_arch.substr(dash + 1);
    if (kind != "real" && kind != "virtual") return false;
    ptx = kind == "virtual";
    compiled_arch = compiled_arch.substr(0, dash);
  }
  const bool arch_specific = !compiled_arch.empty() && compiled_arch.back() == 'a';
  if (arch_specific) compiled_arch.remove_suffix(1);
  int sm = 0;
  auto [end, err] = std::from_chars(compiled_arch.data(), compiled_arch.data() + compiled_arch.size(), sm);
  if (err != std::errc() || end != compiled_arch.data() + compiled_arch.size()) return false;
  if (arch_specific) return sm == device_sm;
  if (ptx) return sm <= device_sm;
  return sm / 10 == device_sm / 10 && sm <= device_sm;
}

int32_t padded_head_dim(int32_t head_dim) {
  for (int32_t width : {64, 96, 128, 192, 256}) {
    if (head_dim <= width) return width;
  }
  return 0;
}

int32_t max_smem_per_block_optin(int device_sm) {
  constexpr int32_t kKB = 1024;
  switch (device_sm) {
    case 70:
    case 72:
      return 96 * kKB;
    case 75:
      return 64 * kKB;
    case 80:
    case 87:
      return 163 * kKB;
    case 86:
    case 89:
    case 120:
    case 121:
      return 99 * kKB;
    case 90:
    case 100:
    case 101:
    case 103:
    case 110:
      return 227 * kKB;
    default:
      return device_sm >= 80 ? 99 * kKB : 48 * kKB;
  }
}

std::vector<std::string> split_archs(std::string_view archs) {
  std::vector<std::string> out;
  while (!archs.empty()) {
    const size_t cut = archs.find_first_of(",;");
    std::string_view item = archs.substr(0, cut);
    if (!item.empty()) out.emplace_back(item);
    if (cut == std::string_view::npos) break;
    archs.remove_prefix(cut + 1);
  }
  return out;
}

Choice choose_kernel(int device_sm, const std::vector<std::string>& compiled_archs, const ProblemKey& problem,
                     const std::vector<KernelEntry>& table, int32_t smem_per_block_optin, bool explain) {
  Choice choice;
  // Varlen runs on the rows that take packed sequences (KernelEntry::varlen): the sm80 family's forward, backward
  // and tangent, the sm90 forward and backward; so on Hopper a varlen call's forward and backward are sm90's, its
  // tangent sm80's (dense tangents run on the sm90 tangent kernel there).
  // Mask mods (issue 38) run on the rows that take the mask bits (KernelEntry::mask_mod): the sm80 and sm90 forward,
  // backward and tangent; so on Hopper all three are sm90's. Varlen with a mask mod (b the sequence, indices
  // sequence-local, the bits over the padded sequences) runs on the rows that take the two together
  // (KernelEntry::varlen_mask_mod: the sm80 forward and backward, on every GPU); not in the tangent, nor in the
  // fused jvp, nor in the backward with deterministic=True (below).
  if (problem.mask_mod && problem.varlen && problem.direction == Direction::kTangent) {
    choice.reason = "no tangent kernel implements mask_mod with varlen (packed) attention yet (jax.jvp of such a "
                    "call evaluates the reference's tangent)";
    return choice;
  }
  // deterministic=True with varlen: no backward orders packed sequences' dq sums (the sm90 backward's counters are
  // laid out per dense batch and query block, the sm80 backward adds with atomics); the call runs on the reference.
  if (problem.varlen && problem.deterministic && problem.direction == Direction::kBwd) {
    choice.reason = "deterministic=True: no backward kernel orders the dq partials of varlen (packed) attention yet";
    return choice;
  }
  if (problem.mask_mod && problem.direction == Direction::kJvp) {
    choice.reason = "the fused jvp kernel does not take mask_mod (jax.jvp of a mask-mod call runs the forward and "
                    "the tangent kernel, which do)";
    return choice;
  }
  bool code_for_device = false;
  for (const std::string& arch : compiled_archs) code_for_device |= arch_runs_on(arch, device_sm);
  if (!code_for_device) {
    std::string archs;
    for (const std::string& arch : compiled_archs) archs += (archs.empty() ? "" : ", ") + ("sm_" + arch);
    choice.reason = "the library holds no code for sm_" + std::to_string(device_sm) + " (built for " +
                    (archs.empty() ? std::string("no architecture") : archs) + ")";
    return choice;
  }
  if (smem_per_block_optin <= 0) smem_per_block_optin = max_smem_per_block_optin(device_sm);
  // Among the entries that match and whose shared memory the device holds, prefer the family written for the
  // newest arch the device has, and of its rows (one per shared-memory budget its tiles are compiled for) the one
  // with the most shared memory: the largest tiles that fit. The table is small; a linear scan keeps the rule obvious.
  const KernelEntry* too_big = nullptr;  // the newest matching family refused for its shared memory (its least)
  const bool ordered = problem.deterministic && problem.direction == Direction::kBwd;
  const KernelEntry* unordered = nullptr;  // a matching kernel refused because it cannot order its dq sums
  for (const KernelEntry& entry : table) {
    const int family_sm = family_min_sm(entry.family);
    const bool family_runs = entry.arch_specific ? family_sm == device_sm : family_sm <= device_sm;
    if (entry.direction != problem.direction || entry.dtype != problem.dtype ||
        entry.head_dim != problem.head_dim || !family_runs ||
        (problem.varlen && !entry.varlen) || (problem.mask_mod && !entry.mask_mod) ||
        (problem.varlen && problem.mask_mod && !entry.varlen_mask_mod)) {
      continue;
    }
    if (ordered && !entry.deterministic) {
      unordered = &entry;
      continue;
    }
    const bool fits = entry.smem_bytes <= smem_per_block_optin;
    const KernelEntry*& slot = fits ? choice.kernel : too_big;
    const int slot_sm = slot != nullptr ? family_min_sm(slot->family) : 0;
    if (slot == nullptr || family_sm > slot_sm ||
        (family_sm == slot_sm && (fits ? entry.smem_bytes > slot->smem_bytes : entry.smem_bytes < slot->smem_bytes))) {
      slot = &entry;
    }
  }
  if (choice.kernel == nullptr && too_big != nullptr) {
    choice.reason = std::string("the ") + too_big->family + " " + direction_name(problem.direction) +
                    " kernel for " + dtype_name(problem.dtype) + " head dim " + std::to_string(problem.head_dim) +
                    " needs " + kb(too_big->smem_bytes) + " of shared memory per block; sm_" +
                    std::to_string(device_sm) + " allows " + kb(smem_per_block_optin);
    return choice;
  }
  if (choice.kernel == nullptr && too_big == nullptr && unordered != nullptr) {
    choice.reason = std::string("deterministic=True: the ") + unordered->family + " backward kernel for " +
                    dtype_name(problem.dtype) + " head dim " + std::to_string(problem.head_dim) +
                    " adds dq partials in any order (atomics); no kernel in this build that runs on sm_" +
                    std::to_string(device_sm) + " orders them for this call";
    return choice;
  }
  if (choice.kernel != nullptr && !explain) return choice;
  if (choice.kernel != nullptr) {
    choice.reason = std::string(choice.kernel->family) + " " + direction_name(problem.direction) + " kernel, " +
                    dtype_name(problem.dtype) + ", head dim " + std::to_string(problem.head_dim) +
                    (ordered ? ", dq partials added in a fixed order (deterministic=True)" : "") +
                    (problem.mask_mod && problem.varlen
                         ? std::string(" (varlen with a mask mod: the newest family whose ") +
                               direction_name(problem.direction) + " takes packed sequences with the mask bits of " +
                               "their padded grid on this sm_" + std::to_string(device_sm) +
                               " device; the sm90 family's do not yet)"
                     : problem.mask_mod
                         ? std::string(" (mask mod: the newest family whose ") + direction_name(problem.direction) +
                               " takes the mask bits on this sm_" + std::to_string(device_sm) +
                               " device, its tiles classified empty / full / partial; the sm90 family's forward, "
                               "backward and tangent walk per-tile block lists of the non-empty tiles)"
                     : problem.varlen
                         ? std::string(" (varlen: the newest family whose ") + direction_name(problem.direction) +
                               " takes packed sequences on this sm_" + std::to_string(device_sm) +
                               " device; the sm90 family's forward and backward do, its tangent not yet)"
                     : " (the newest family this sm_" + std::to_string(device_sm) + " device runs)");
    if (too_big != nullptr && family_min_sm(too_big->family) > family_min_sm(choice.kernel->family)) {
      choice.reason += std::string("; the ") + too_big->family + " kernel needs " + kb(too_big->smem_bytes) +
                       " of shared memory per block, more than sm_" + std::to_string(device_sm) + " allows (" +
                       kb(smem_per_block_optin) + ")";
    } else if (too_big != nullptr && too_big->family == std::string_view(choice.kernel->family)) {
      choice.reason += std::string("; its smaller tiles (") + kb(choice.kernel->smem_bytes) +
                       " of shared memory per block): the larger ones need " + kb(too_big->smem_bytes) + ", sm_" +
                       std::to_string(device_sm) + " allows " + kb(smem_per_block_optin);
    }
  } else {
    choice.reason = std::string("no ") + direction_name(problem.direction) + " kernel for " +
                    dtype_name(problem.dtype) + " head dim " + std::to_string(problem.head_dim) + " on sm_" +
                    std::to_string(device_sm) + " in this build (its kernel set may be the small CI one)";
  }
  return choice;
}

}  // namespace flashjax
