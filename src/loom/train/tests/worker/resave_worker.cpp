// Test worker of the checkpoint round trips between layouts (test_trainer_pp.cpp), started as
//   loom launch --nproc N --exec -- loom_resave_worker OUT_FOLDER --config FILE [--key=value ...]
// Every rank builds the Trainer of that config (which resumes from the newest checkpoint in its
// run folder, in this run's layout) and saves the loaded state, without training, as
// OUT_FOLDER/step-<N>. Exits 1 with "rank R: error: ..." on failure.
#include <cstdio>
#include <string>
#include <vector>

#include "loom/distributed/launch_env.h"
#include "loom/train/trainer.h"

int main(int argc, char** argv) {
  int rank = -1;
  try {
    rank = loom::distributed::detect_launch_env().rank;
    LOOM_REQUIRE(argc >= 4 && std::string(argv[2]) == "--config",
                 "usage: loom_resave_worker OUT_FOLDER --config FILE [--key=value ...]");
    const std::vector<std::string> overrides(argv + 4, argv + argc);
    loom::train::Trainer trainer(loom::train::load_job_config(argv[3], overrides));
    trainer.save_checkpoint_to(argv[1]);
    std::printf("rank %d: saved step %lld to %s\n", rank, static_cast<long long>(trainer.step()), argv[1]);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: error: %s\n", rank, e.what());
  }
  return 1;
}
