"""The launcher's own source, run inside a sandbox (see `dagster_rl.sandbox.launcher`): standard library only.

Never imported by the project; `launcher.SOURCE` holds this file's text, which the sandbox's
interpreter runs as `python3 -I -S -c SOURCE CONFIG`.
"""

import json
import os
import resource
import sys


def main() -> None:
    config = json.loads(sys.argv[1])
    report = config["report_fd"]
    os.set_inheritable(report, False)
    os.write(report, b'{"started": true}\n')
    pid = os.fork()
    if pid == 0:
        try:
            for name, (soft, hard) in config["rlimits"].items():
                resource.setrlimit(getattr(resource, name), (soft, hard))
            os.execvpe(config["argv"][0], config["argv"], config["env"])
        except BaseException as e:  # whatever stops the exec is reported
            os.write(report, json.dumps({"exec_error": f"{type(e).__name__}: {e}"}).encode() + b"\n")
        os._exit(127)
    os.close(0)  # the program reads stdin; the launcher never does
    _, status, usage = os.wait4(pid, 0)
    cpu_s = round(usage.ru_utime + usage.ru_stime, 3)
    if os.WIFSIGNALED(status):
        ending = {"signal": os.WTERMSIG(status), "cpu_s": cpu_s}
    else:
        ending = {"exit": os.WEXITSTATUS(status), "cpu_s": cpu_s}
    os.write(report, json.dumps(ending).encode() + b"\n")


if __name__ == "__main__":
    main()
