// The run-time settings: environment variables read once per process, all named in one table so that a reader (and
// `python -m flashjax`, through the build info) finds every knob in one place. They are test and comparison knobs:
// the defaults are what users run.
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>

namespace flashjax {

enum class Setting : int {
  kDisableFamilies,  // kernel families dispatch skips
  kSm90PackGqa,      // sm90 forward: GQA packing
  kSm90SplitKv,      // sm90 forward: key splitting
  kSm90MaxCtas,      // sm90 forward: persistent grid cap
  kSm90Pdl,          // sm90 forward: programmatic dependent launch
  kSm90VarlenWalk,   // sm90 varlen forward: how CTAs share the walk
  kSmemLimitKb,      // cap on the shared memory per block dispatch assumes
  kCount,
};

struct SettingInfo {
  Setting setting;
  const char* name;     // the environment variable
  const char* meaning;  // what its values do
};

inline constexpr SettingInfo kSettings[] = {
    {Setting::kDisableFamilies, "FLASHJAX_DISABLE_FAMILIES",
     "families dispatch skips, separated by commas (e.g. 'sm90': the portable family on a Hopper GPU)"},
    {Setting::kSm90PackGqa, "FLASHJAX_SM90_PACK_GQA",
     "sm90 forward GQA packing: 'auto' (default) where it saves tiles, '0' never, '1' every GQA call"},
    {Setting::kSm90SplitKv, "FLASHJAX_SM90_SPLIT_KV",
     "sm90 forward key splitting: 'auto' (default) where tiles fill at most half the SMs, '0' never, 'n' n parts"},
    {Setting::kSm90MaxCtas, "FLASHJAX_SM90_MAX_CTAS",
     "sm90 forward: cap the persistent grid at n CTAs, so that small problems run many tiles per CTA (tests)"},
    {Setting::kSm90Pdl, "FLASHJAX_SM90_PDL",
     "sm90 forward: '0' launches without programmatic dependent launch (default '1')"},
    {Setting::kSm90VarlenWalk, "FLASHJAX_SM90_VARLEN_WALK",
     "sm90 varlen forward: '2' (default) hands tiles out at run time from a counter (each sequence's blocks "
     "heaviest first), '1' gives each CTA a range of equal modelled cost, '0' deals tiles round robin "
     "(docs/performance.md 2.8)"},
    {Setting::kSmemLimitKb, "FLASHJAX_SMEM_LIMIT_KB",
     "cap, in KB, on the shared memory per block dispatch assumes (e.g. '99': an H200 picks the kernels and tiles of "
     "a 99 KB GPU, RTX 4090 / L40 / RTX 5090); unset: the device's own limit"},
};
static_assert(sizeof(kSettings) / sizeof(kSettings[0]) == static_cast<int>(Setting::kCount),
              "every setting has one row");

// The setting's value as the process started with it ("" when unset). Read once per process: a later setenv does
// not change what the library does, so that every call of a process runs the same plan.
inline const std::string& setting_text(Setting setting) {
  static const auto values = [] {
    struct Values {
      std::string text[static_cast<int>(Setting::kCount)];
    } values;
    for (const SettingInfo& info : kSettings) {
      const char* value = std::getenv(info.name);
      values.text[static_cast<int>(info.setting)] = value != nullptr ? value : "";
    }
    return values;
  }();
  return values.text[static_cast<int>(setting)];
}

// The setting as an integer: `unset` when it is unset, empty or "auto", else its leading integer (0 when it has none).
inline int setting_int(Setting setting, int unset) {
  const std::string& text = setting_text(setting);
  if (text.empty() || text == "auto") return unset;
  return std::atoi(text.c_str());
}

}  // namespace flashjax
