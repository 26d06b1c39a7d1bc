// The contract between `loom launch` (the only writer of memberships) and the ranks of an elastic
// job (fault_tolerance.enable, src/loom/elastic/): store keys, what they hold, and the exit code
// that asks for today's restart-from-checkpoint. Everything lives in the launcher's store under the
// attempt's prefix ("/worker/attempt_<restart_count>", the prefix the ranks' own store uses), so a
// full restart starts from a fresh membership.
//
// A *member* is one rank process, named by an id that never changes and is never reused: the
// launcher's first ranks are members 0..W-1 (their RANK), each replacement the next unused id. A
// *generation* is one membership; the ranks of a generation are its members in list order.
//
//   1. Before starting the ranks the launcher writes kGenerationKeyPrefix + "0" = {"members":
//      [0..W-1], "reason": "start"} and then kGenerationKey = "0".
//   2. A member that exits non-zero or by a signal (other than exit 2 or 3, which end the launch as
//      before, and kExitElasticRestart) is dropped: the launcher writes generation g+1 = the
//      members still alive, in the same order, with "lost": [id] and a "reason" naming the exit,
//      then sets kGenerationKey = g+1. The survivors, which poll kGenerationKey, abandon the step
//      in flight and re-form. While restarts are left (--max-restarts) it starts a replacement with
//      LOOM_ELASTIC_MEMBER = a new id and LOOM_ELASTIC_JOINER = 1 (RANK = the lost member's rank,
//      WORLD_SIZE unchanged, so the environment stays valid; an elastic rank ignores both).
//   3. A replacement that has loaded (its model config read, ready to take state) sets
//      kReadyKeyPrefix + id. The launcher then sets kJoinRequestKey = "<g>" (the current
//      generation). The ranks of g read that key at every step boundary; when it names their
//      generation they finish the step, stop together, and rank 0 of g sets kYieldKeyPrefix + g =
//      "<step>". On that key the launcher writes generation g+1 = the members of g followed by the
//      ready replacements ("joined": [ids]) and sets kGenerationKey. (Should every ready
//      replacement have died meanwhile, g+1 still follows the yield, with the members of g and
//      "joined": [], so that the members who stopped re-form.) kJoinRequestKey keeps naming an
//      old generation after a join; ranks only act on it when it names theirs.
//   4. A member that dies while a generation is being formed is dropped the same way (a newer
//      generation supersedes one being formed: members re-read kGenerationKey while they wait).
//   5. Rank 0 of the generation that finishes training sets kDoneKey = "<step>" before exiting 0;
//      members that are not training (spares) exit 0 on it. The launch succeeds when every member
//      alive has exited 0. A member lost after kDoneKey is set is only logged: no new generation,
//      no replacement.
//   6. A member that exits kExitElasticRestart says the job cannot continue in place (state lost
//      with no copy left, a model-parallel group lost without a data-parallel replica): every
//      member exits so, each having said why in one line; the launcher then stops them all and
//      restarts the whole group as without fault tolerance (a restart, from the newest checkpoint).
#pragma once

namespace loom::distributed {

inline constexpr const char* kGenerationKey = "loom/elastic/generation";
inline constexpr const char* kGenerationKeyPrefix = "loom/elastic/gen/";
inline constexpr const char* kReadyKeyPrefix = "loom/elastic/ready/";
inline constexpr const char* kJoinRequestKey = "loom/elastic/join_request";
inline constexpr const char* kYieldKeyPrefix = "loom/elastic/yield/";
inline constexpr const char* kDoneKey = "loom/elastic/done";

// Environment of an elastic rank (set by `loom launch` when the job has fault_tolerance.enable).
inline constexpr const char* kElasticMemberEnv = "LOOM_ELASTIC_MEMBER";
inline constexpr const char* kElasticJoinerEnv = "LOOM_ELASTIC_JOINER";

// Exit code of an elastic rank that asks for a restart of the whole group (see 6 above).
inline constexpr int kExitElasticRestart = 5;

}  // namespace loom::distributed
