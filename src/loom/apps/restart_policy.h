// Wiring between `loom launch` (dist) and the checkpoint format, which the dist layer cannot see.
#pragma once

namespace loom::apps {

// Makes each restart line of `loom launch --max-restarts R --checkpoint-folder DIR` name the
// checkpoint the ranks will resume from (checkpoint::decide_restart), or say that none is complete
// yet; and makes `--checkpoint-folder` be checked against the folder the ranks' `train` command
// actually checkpoints into. Call once in main(), before parsing the command line.
void install_checkpoint_restart_policy();

}  // namespace loom::apps
