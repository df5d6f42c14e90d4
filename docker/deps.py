"""Print pyproject.toml's dependencies plus those of the given extras, one a line, with the project's references
to its own extras (`rollway[engine,train]`) expanded: docker/Dockerfile installs them in a layer of their own,
which only a change of pyproject.toml rebuilds.   python deps.py pyproject.toml all > requirements.txt"""

import re
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
extras = project.get("optional-dependencies", {})
out = list(project.get("dependencies", []))
todo = [e for e in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if e]
done: set[str] = set()
while todo:
    extra = todo.pop()
    if extra in done:
        continue
    done.add(extra)
    for req in extras[extra]:
        own = re.fullmatch(rf"{re.escape(project['name'])}\[([^\]]+)\]", req.replace(" ", ""))
        if own:
            todo += own.group(1).split(",")
        else:
            out.append(req)
print("\n".join(dict.fromkeys(out)))
