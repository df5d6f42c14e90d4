"""torchrun (`torch.distributed.run`) as `rollway train` starts it, without the traceback of a stop.

On SIGTERM or SIGINT torchrun's agent raises `SignalException`, stops its workers and re-raises it, so a
plain stop ended in a ~30-line traceback (in the terminal, and in every `rollway demo`'s trainer.log, which
stops its trainer that way). Here that exception ends the process quietly with the shell's 128 + signal;
everything else (a worker that failed, a bad argument) is torchrun's own handling and output.

    python -m trainer.torchrun --standalone --nproc-per-node N -m trainer.train --config FILE
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except SignalException as e:
        logging.getLogger("rollway.train").info("stopped by %s: workers stopped", e.sigval)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
