"""Stand-in for pypa's get-pip.py, which ansible-test downloads from ci-files.testing.ansible.com to put pip into the
empty virtual environments of its sanity tests. That host is out of reach on these machines (only the package
registries are), so: pip from the interpreter's own ensurepip, then the requested pip install from the index.
ensurepip runs in a child process: in-process it clears PIP_* and points PIP_CONFIG_FILE at /dev/null, which
would drop the machine's pip configuration (index, CA bundle) for the install that follows."""

import subprocess
import sys

args = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
subprocess.check_call([sys.executable, "-m", "ensurepip", "--upgrade"], stdout=subprocess.DEVNULL)
sys.exit(subprocess.call([sys.executable, "-m", "pip", "install", *args]))
