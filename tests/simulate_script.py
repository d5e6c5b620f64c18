"""Runs ``zerodp.tools.simulate.simulate`` jobs, each in a process forked from this one (a fresh
fake process group, nothing left by the one before) and prints their results as one JSON list;
tests/test_simulate.py."""
import json
import multiprocessing as mp
import sys
import warnings


def one(job, conn):
    warnings.simplefilter("ignore")
    from zerodp.tools.simulate import simulate
    model = job.pop("model")
    conn.send(simulate(model, **job).to_dict())
    conn.close()


if __name__ == "__main__":
    import zerodp.tools.simulate  # noqa: F401 - imported once, before the forks
    ctx = mp.get_context("fork")
    out = []
    for job in json.loads(sys.argv[1]):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=one, args=(job, child))
        p.start()
        child.close()
        out.append(parent.recv())
        p.join()
    print(json.dumps(out))
