import {
  IDevice,
  confirmLabel,
  ISelection,
  kernelInfoFor,
  kernelSelection,
  moveActionFor,
  parseDevice,
  parseHolders,
  parseMoveResult,
  recommendationAction,
  recommendationText,
  selectPath
} from '../model';

const GiB = 1024 ** 3;

function device(index: number, extra: Record<string, unknown> = {}): IDevice {
  return parseDevice({
    index,
    uuid: `GPU-${index}`,
    name: 'NVIDIA L4',
    label: `GPU ${index}`,
    memory_total_bytes: 24 * GiB,
    memory_used_bytes: GiB,
    available: true,
    ...extra
  });
}

/** The holders answer of tests/server/test_move.py: one autogpu kernel on GPU 0, one plain kernel. */
const holdersJson = {
  timestamp_s: 1,
  simulated: false,
  user: 'me',
  errors: [],
  holders: [],
  kernels: [
    {
      kernel_id: 'k-autogpu',
      notebook_path: 'work/train.ipynb',
      movable: true,
      picked_uuids: ['GPU-0'],
      constraints_text: 'min free 10.0 GiB',
      note: null,
      best_move: { target: 'best', uuids: ['GPU-1'], labels: ['GPU 1'] }
    },
    {
      kernel_id: 'k-plain',
      notebook_path: 'plain.ipynb',
      movable: false,
      picked_uuids: [],
      constraints_text: null,
      note: null
    }
  ]
};

describe('kernelInfoFor', () => {
  const holders = parseHolders(holdersJson);

  it('finds the active notebook kernel among the server kernels', () => {
    expect(kernelInfoFor(holders, 'k-autogpu')).toEqual({
      kernel_id: 'k-autogpu',
      notebook_path: 'work/train.ipynb',
      execution_state: null,
      idle_s: null,
      movable: true,
      picked_uuids: ['GPU-0'],
      constraints_text: 'min free 10.0 GiB',
      note: null,
      overload: null,
      better: null,
      waiting: false,
      allowed_uuids: null,
      best_move: { target: 'best', uuids: ['GPU-1'], labels: ['GPU 1'] },
      cull_warning: null
    });
    expect(kernelInfoFor(holders, 'k-other')).toBeNull();
    expect(kernelInfoFor(holders, null)).toBeNull();
    expect(kernelInfoFor(null, 'k-autogpu')).toBeNull();
  });

  it('reads an older server without the kernels list as no kernels', () => {
    const old: Record<string, unknown> = { ...holdersJson };
    delete old.kernels;
    expect(parseHolders(old).kernels).toEqual([]);
  });

  it('rejects a kernel entry without an id', () => {
    expect(() =>
      parseHolders({ ...holdersJson, kernels: [{ movable: true }] })
    ).toThrow('unexpected kernel from the server: {"movable":true}');
  });
});

describe('moveActionFor', () => {
  const holders = parseHolders(holdersJson);
  const mine = kernelInfoFor(holders, 'k-autogpu');
  const plain = kernelInfoFor(holders, 'k-plain');

  it('offers "Move to best GPU" on the card of the device the kernel holds', () => {
    expect(moveActionFor(device(0), mine)).toEqual({
      kind: 'best',
      target: 'best',
      label: 'Move to best GPU',
      title:
        "Restart this notebook's kernel on GPU 1, the best GPU now (its variables are lost)"
    });
  });

  it('offers no move away from the best GPU (issue 41: the ping-pong)', () => {
    // the server names no better GPU than the kernel's own: its card offers nothing
    const onBest = { ...mine!, best_move: null };
    expect(moveActionFor(device(0), onBest)).toBeNull();
    // the other cards still offer a move there, by name
    expect(moveActionFor(device(1), onBest)?.target).toBe('GPU-1');
  });

  it('moves an overloaded kernel to the better device by name', () => {
    const overloaded = {
      ...mine!,
      best_move: { target: 'GPU-2', uuids: ['GPU-2'], labels: ['GPU 2'] }
    };
    expect(moveActionFor(device(0), overloaded)?.target).toBe('GPU-2');
  });

  it('offers "Move here" on the other cards, by UUID', () => {
    expect(moveActionFor(device(2), mine)).toEqual({
      kind: 'here',
      target: 'GPU-2',
      label: 'Move here',
      title: "Restart this notebook's kernel on GPU 2 (its variables are lost)"
    });
  });

  it('offers nothing for a kernel not started by the autogpu kernelspec', () => {
    expect(moveActionFor(device(0), plain)).toBeNull();
    expect(moveActionFor(device(1), plain)).toBeNull();
    expect(moveActionFor(device(1), null)).toBeNull();
  });

  it('offers nothing on a lost device', () => {
    expect(
      moveActionFor(device(3, { available: false, error: 'GPU is lost' }), mine)
    ).toBeNull();
  });

  it('reads a server without best_move as no move to offer', () => {
    const old = parseHolders({
      ...holdersJson,
      kernels: [{ ...holdersJson.kernels[0], best_move: 'GPU-1' }]
    });
    expect(old.kernels[0].best_move).toBeNull();
  });

  it('offers only "best" to a kernel on two GPUs', () => {
    const two = { ...mine!, picked_uuids: ['GPU-0', 'GPU-1'] };
    expect(moveActionFor(device(1), two)?.kind).toBe('best');
    expect(moveActionFor(device(2), two)).toBeNull();
  });

  it('lets a CPU-only autogpu kernel move to any device', () => {
    const cpu = { ...mine!, picked_uuids: [] };
    expect(moveActionFor(device(0), cpu)?.target).toBe('GPU-0');
  });
});

describe('parseMoveResult and confirmLabel', () => {
  it('reads the dry run the dialog shows', () => {
    const plan = parseMoveResult({
      dry_run: true,
      plan: 'The kernel will restart on GPU 1 (NVIDIA L4, 23.0 GiB free), ...',
      message:
        'The kernel will restart on GPU 1 (NVIDIA L4, 23.0 GiB free), ...',
      target: ['GPU-1'],
      target_labels: ['GPU 1'],
      picked: null,
      note: null
    });
    expect(plan.dry_run).toBe(true);
    expect(plan.picked).toBeNull();
    expect(plan.pending).toBe(false);
    expect(confirmLabel(plan)).toBe('Restart on GPU 1');
  });

  it("reads a move recorded for the notebook's own restart", () => {
    const pending = parseMoveResult({
      dry_run: false,
      pending: true,
      message: "The move to GPU 1 waits for the kernel's restart.",
      target: ['GPU-1'],
      target_labels: ['GPU 1'],
      picked: null,
      note: null
    });
    expect(pending.pending).toBe(true);
    expect(pending.picked).toBeNull();
  });

  it('reads the result of a move', () => {
    const result = parseMoveResult({
      dry_run: false,
      plan: 'p',
      message: 'The kernel restarted on GPU 2; its state (variables) was lost.',
      target: ['GPU-2'],
      target_labels: ['GPU 2'],
      picked: ['GPU-2'],
      note: "moved at your request: the kernel's state was lost"
    });
    expect(result.picked).toEqual(['GPU-2']);
    expect(result.message).toBe(
      'The kernel restarted on GPU 2; its state (variables) was lost.'
    );
  });

  it('rejects an answer without a message', () => {
    expect(() => parseMoveResult({ target: [] })).toThrow(
      'unexpected move answer from the server: {"target":[]}'
    );
  });
});

describe('selectPath', () => {
  it('asks for the sidebar min free, for the active kernel', () => {
    expect(selectPath('10G', 'k-1')).toBe('select?min_free=10G&kernel_id=k-1');
    expect(selectPath(' 25% ', null)).toBe('select?min_free=25%25');
    expect(selectPath('', 'k-1')).toBe('select?kernel_id=k-1');
    expect(selectPath('', null)).toBe('select');
  });
});

describe('the recommendation line carries its action (issue 41)', () => {
  const holders = parseHolders(holdersJson);
  const mine = kernelInfoFor(holders, 'k-autogpu')!;
  const devices = [0, 1, 2].map(i => device(i));
  const select = (uuid: string, label: string): ISelection => ({
    chosen: [{ uuid, label, name: 'NVIDIA L4' }],
    constraints_text: 'min free 10.0 GiB',
    message: null,
    simulated: false
  });

  it('offers "Pick GPU 2" to a notebook without a GPU', () => {
    const plain = kernelInfoFor(holders, 'k-plain');
    const action = recommendationAction(
      select('GPU-2', 'GPU 2'),
      plain,
      holders,
      'k-plain',
      devices
    );
    expect(action).toMatchObject({
      kind: 'pick',
      uuid: 'GPU-2',
      label: 'Pick GPU 2'
    });
    expect(action?.code).toContain('sidebar_pick("GPU-2")');
  });

  it('offers nothing to a plain kernel that holds a GPU already', () => {
    const holding = parseHolders({
      ...holdersJson,
      holders: [
        {
          kind: 'lease',
          uuid: 'GPU-0',
          kernel_id: 'k-plain',
          this_server: true
        }
      ]
    });
    expect(
      recommendationAction(
        select('GPU-2', 'GPU 2'),
        kernelInfoFor(holding, 'k-plain'),
        holding,
        'k-plain',
        devices
      )
    ).toBeNull();
  });

  it('offers "Move to GPU 1" where the server names a better GPU for the kernel', () => {
    expect(
      recommendationAction(
        select('GPU-2', 'GPU 2'),
        mine,
        holders,
        'k-autogpu',
        devices
      )
    ).toMatchObject({ kind: 'move', target: 'best', label: 'Move to GPU 1' });
  });

  it('offers nothing to a kernel on the best GPU, and says it is there', () => {
    const onBest = { ...mine, best_move: null };
    const kernels = { ...holders, kernels: [onBest] };
    expect(
      recommendationAction(
        select('GPU-2', 'GPU 2'),
        onBest,
        kernels,
        'k-autogpu',
        devices
      )
    ).toBeNull();
    // the line is the kernel's own decision, not the sidebar's select
    const line = kernelSelection(select('GPU-2', 'GPU 2'), onBest, devices);
    expect(line?.chosen.map(c => c.uuid)).toEqual(['GPU-0']);
    expect(recommendationText(line!, ['GPU-0'])).toBe(
      'you are already on the best device for 10.0 GiB: GPU\u00a00'
    );
    const better = kernelSelection(select('GPU-2', 'GPU 2'), mine, devices);
    expect(recommendationText(better!, ['GPU-0'])).toBe(
      'best device for 10.0 GiB: GPU\u00a01'
    );
  });

  it('offers nothing without a notebook', () => {
    expect(
      recommendationAction(
        select('GPU-2', 'GPU 2'),
        null,
        holders,
        null,
        devices
      )
    ).toBeNull();
  });
});
