"""Lesson 11's mutants: plausible mistakes in each TODO of solutions/11_where_the_time_goes.py, each of which its
TODO's tests must catch (python -m tests.mutants --lesson 11), and VARIANTS: other correct answers, which they must
accept.

"Events of every phase classified" is listed although, in the traces torch.profiler writes today, the events that are
not complete ("X") are memory instants, flow arrows and metadata, which the other rules leave out anyway: the TODO's
contract says complete events only, and the check holds it to that with work-like events of other phases.
"""

from tests.mutants import Mutant

COMMENT_MAY_NAME = {  # names TODO comments may use: what the notebook introduces before the TODO
    "COMMUNICATION_CALLS": "the training thread's communication calls, listed above TODO 1 and in the notebook",
}

KERNEL = """    if category == "kernel":
        return "communication" if "nccl" in name.lower() else "computation"
"""
OTHER_THREAD = """    if event.get("tid") != thread:
        return "communication" if name.startswith("gloo:") else None
"""
WAITING = """    if name.startswith(COMMUNICATION_CALLS) or "wait" in name.lower():
        return "waiting"
"""
MERGE = "        if merged and start <= merged[-1][1]:\n"
EXTEND = "            merged[-1] = (merged[-1][0], max(merged[-1][1], end))\n"
ADVANCE = "        if a[i][1] < b[j][1]:\n            i += 1\n        else:\n            j += 1\n"
RANKING = "sorted(costs.items(), key=lambda item: item[1][1] / item[1][0], reverse=True)"
FITS = "        if used + size <= cap_bytes:\n"
FITTING = '    fitting = [row for row in rows if row["peak_bytes"] <= cap_bytes]\n'
BEST = '    return max(fitting, key=lambda row: (row["tokens_per_s"], -row["peak_bytes"]))\n'

MUTANTS = [
    # TODO 1: the kind of an event
    Mutant(
        todo=1,
        what="every event on another thread taken as communication (not only gloo's)",
        find=OTHER_THREAD,
        replace='    if event.get("tid") != thread:\n        return "communication"\n',
        shows=("aten::add_", "got 'communication'"),
    ),
    Mutant(
        todo=1,
        what="the thread checked before the category: a GPU's kernels (on their stream's row) never count",
        find=KERNEL + OTHER_THREAD,
        replace=OTHER_THREAD + KERNEL,
        shows=("ncclDevKernel", "got None"),
    ),
    Mutant(
        todo=1,
        what="every GPU kernel taken as computation, NCCL's too",
        find=KERNEL,
        replace='    if category == "kernel":\n        return "computation"\n',
        shows=("ncclDevKernel", "got 'computation'"),
    ),
    Mutant(
        todo=1,
        what="communication calls on the training thread counted as communication, not waiting",
        find=WAITING,
        replace=WAITING.replace('"waiting"', '"communication"'),
        shows=("is 'waiting'", "got 'communication'"),
    ),
    Mutant(
        todo=1,
        what="annotations (ProfilerStep#, DistributedDataParallel.forward) counted as computation",
        find='    return "computation" if category == "cpu_op" else None\n',
        replace='    return "computation"\n',
        shows=("ProfilerStep", "got 'computation'"),
    ),
    Mutant(
        todo=1,
        what="the data loader's batches counted as computation",
        find='    if name.startswith("enumerate(DataLoader)"):\n        return "data"\n',
        replace="",
        shows=("DataLoader", "is 'data'"),
    ),
    Mutant(
        todo=1,
        what="only c10d's operators as waiting: gloo's point-to-point and the waits computing",
        find=WAITING,
        replace='    if name.startswith("c10d::"):\n        return "waiting"\n',
        shows=("gloo:recv", "is 'waiting'"),
    ),
    Mutant(
        todo=1,
        what="events of every phase classified: an instant or a begin marker counted as work",
        find='    if event.get("ph") != "X":\n        return None\n',
        replace="",
        shows=("phase i", "is None"),
    ),
    # TODO 2: the union
    Mutant(
        todo=2,
        what="not sorted first: intervals given out of order are not merged",
        find="    for start, end in sorted(intervals):\n",
        replace="    for start, end in intervals:\n",
        shows=("union of", "got [(5, 8)]"),
    ),
    Mutant(
        todo=2,
        what="a nested interval shortens the merged one (its end taken, not the larger end)",
        find=EXTEND,
        replace="            merged[-1] = (merged[-1][0], end)\n",
        shows=("union of", "got [(1, 3), (4, 5)]"),
    ),
    Mutant(
        todo=2,
        what="touching intervals kept apart (< instead of <=)",
        find=MERGE,
        replace="        if merged and start < merged[-1][1]:\n",
        shows=("is [(1, 4)]",),
    ),
    Mutant(
        todo=2,
        what="empty intervals kept",
        find="        if end <= start:\n            continue\n",
        replace="",
        shows=("(9, 9)",),
    ),
    Mutant(
        todo=2,
        what="the union as the sum of lengths' bounds: one interval from the first start to the last end",
        find="    return merged\n",
        replace="    return merged[:1] and [(merged[0][0], max(e for _, e in merged))]\n",
        shows=("got [(1, 8)]",),
    ),
    # TODO 3: the intersection
    Mutant(
        todo=3,
        what="the two sets not united first (overlaps within one set counted twice, or missed)",
        find="    a, b = union(a), union(b)\n",
        replace="    a, b = sorted(a), sorted(b)\n",
        shows=("intersection of", "got [(3, 4.5), (4, 5)]"),
    ),
    Mutant(
        todo=3,
        what="both indices advanced after every pair: later overlaps missed",
        find=ADVANCE,
        replace="        i += 1\n        j += 1\n",
        shows=("got [(2, 3)]",),
    ),
    Mutant(
        todo=3,
        what="the wrong index advanced (past the interval that ends later)",
        find=ADVANCE,
        replace="        if a[i][1] > b[j][1]:\n            i += 1\n        else:\n            j += 1\n",
        shows=("got [(2, 3)]",),
    ),
    Mutant(
        todo=3,
        what="the overlap from the earlier start to the later end (the pair's hull, not its overlap)",
        find="        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])\n",
        replace="        start, end = min(a[i][0], b[j][0]), max(a[i][1], b[j][1])\n",
        shows=("got [(0, 10), (0, 10)]",),
    ),
    Mutant(
        todo=3,
        what="touching intervals kept as empty overlaps",
        find="        if start < end:\n            both.append((start, end))\n",
        replace="        if start <= end:\n            both.append((start, end))\n",
        shows=("is []", "got [(2, 2)]"),
    ),
    # TODO 4: selective checkpointing under a cap
    Mutant(
        todo=4,
        what="ranked by FLOPs alone, not per byte",
        find=RANKING,
        replace="sorted(costs.items(), key=lambda item: item[1][1], reverse=True)",
        shows=("got ['add', 'mm']",),
    ),
    Mutant(
        todo=4,
        what="ranked by bytes, smallest first",
        find=RANKING,
        replace="sorted(costs.items(), key=lambda item: item[1][0])",
        shows=("got ['gelu', 'norm']",),
    ),
    Mutant(
        todo=4,
        what="stops at the first operation that does not fit instead of passing over it",
        find=FITS + "            kept.add(name)\n            used += size\n",
        replace="        if used + size > cap_bytes:\n            break\n            \n"
        "        kept.add(name)\n        used += size\n",
        shows=("got []",),
    ),
    Mutant(
        todo=4,
        what="the cap itself does not fit (< instead of <=)",
        find=FITS,
        replace="        if used + size < cap_bytes:\n",
        shows=("got ['mm']",),
    ),
    Mutant(
        todo=4,
        what="the cheapest per byte kept first (ranking reversed)",
        find=RANKING,
        replace="sorted(costs.items(), key=lambda item: item[1][1] / item[1][0])",
        shows=("got ['gelu', 'norm']",),
    ),
    # TODO 5: the fastest configuration under a cap
    Mutant(
        todo=5,
        what="a configuration at exactly the cap refused (< instead of <=)",
        find=FITTING,
        replace='    fitting = [row for row in rows if row["peak_bytes"] < cap_bytes]\n',
        shows=("is compile, got baseline",),
    ),
    Mutant(
        todo=5,
        what="the cap ignored: the fastest of all",
        find=FITTING,
        replace="    fitting = list(rows)\n",
        shows=("is baseline, got compile",),
    ),
    Mutant(
        todo=5,
        what="a tie goes to the larger memory",
        find=BEST,
        replace='    return max(fitting, key=lambda row: (row["tokens_per_s"], row["peak_bytes"]))\n',
        shows=("is fused, got selective",),
    ),
    Mutant(
        todo=5,
        what="the smallest memory that fits, not the fastest",
        find=BEST,
        replace='    return min(fitting, key=lambda row: row["peak_bytes"])\n',
        shows=("is compile, got full checkpointing",),
    ),
    Mutant(
        todo=5,
        what="the first row that fits",
        find=BEST,
        replace="    return fitting[0]\n",
        shows=("is compile, got baseline",),
    ),
]

VARIANTS = [
    Mutant(todo=2, what="the union with a stack and a final sort-free pass over sorted starts",
           find="    for start, end in sorted(intervals):\n" "        if end <= start:\n            continue\n"
                + MERGE + EXTEND + "        else:\n            merged.append((start, end))\n",
           replace="    for start, end in sorted((s, e) for s, e in intervals if e > s):\n"
                   "        if merged and start <= merged[-1][1]:\n"
                   "            if end > merged[-1][1]:\n                merged[-1] = (merged[-1][0], end)\n"
                   "        else:\n            merged.append((start, end))\n"),
    Mutant(todo=3, what="the intersection as every pair's overlap, then united",
           find="    both, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
                "        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])\n"
                "        if start < end:\n            both.append((start, end))\n" + ADVANCE + "    return both\n",
           replace="    pairs = [(max(s, t), min(e, f)) for s, e in a for t, f in b]\n"
                   "    return union([(s, e) for s, e in pairs if s < e])\n"),
    Mutant(todo=4, what="ranked with the cost per byte written as a division in a helper list",
           find=RANKING, replace="sorted(costs.items(), key=lambda item: -item[1][1] / item[1][0])"),
    Mutant(todo=5, what="sorted by (-tokens/s, memory), the first that fits",
           find=FITTING + "    if not fitting:\n        return None\n" + BEST,
           replace='    for row in sorted(rows, key=lambda row: (-row["tokens_per_s"], row["peak_bytes"])):\n'
                   '        if row["peak_bytes"] <= cap_bytes:\n            return row\n    return None\n'),
]  # fmt: skip
