#include "loom/apps/restart_policy.h"

#include "loom/checkpoint/metadata.h"
#include "loom/distributed/launcher.h"

namespace loom::apps {

void install_checkpoint_restart_policy() {
  distributed::set_resume_describer([](const std::filesystem::path& folder, int restarts_done,
                                int max_restarts) -> std::string {
    // Structure-level verification (markers, metadata, file sizes) is quick; the ranks verify
    // checksums when they load and fall back to an older checkpoint themselves if needed.
    const checkpoint::RestartDecision d =
        checkpoint::decide_restart(folder, restarts_done, max_restarts);
    if (d.resume_from) {
      return c10::str("ranks resume from checkpoint '", d.resume_from->path.string(), "' (step ",
                      d.resume_from->step, ")");
    }
    return c10::str("no complete checkpoint in '", folder.string(),
                    "' yet; ranks start from scratch");
  });
}

}  // namespace loom::apps
