import {
  IHolder,
  IHistory,
  ISeries,
  formatBytes,
  formatMemory,
  formatPct,
  formatIdle,
  formatThermals,
  formatUserTotal,
  holdersFor,
  ITrans,
  myDevices,
  noTranslation,
  nobodyText,
  overloadAdvice,
  overloadToNotify,
  parsePickOutcome,
  pickCodeFor,
  uniqueErrors,
  waitsEnded,
  mergeHistory,
  parseDevice,
  parseFleet,
  parseHistory,
  parseHolders,
  parseSelection,
  notebookDevices,
  recommendationText,
  sparkScaleTop,
  sparklinePath,
  unsupportedNote,
  userTotals
} from '../model';

const GiB = 1024 ** 3;

/** The devices answer of tests/server/test_rest.py's fleet, as the server sends it. */
const fleetJson = {
  timestamp_s: 1718000000.5,
  backend: 'simulated',
  simulated: true,
  driver_version: '550.54.15',
  errors: [],
  interval_s: 1.0,
  devices: [
    {
      index: 0,
      uuid: 'GPU-0a0a',
      name: 'NVIDIA A100-SXM4-80GB',
      pci_bus_id: '00000000:07:00.0',
      memory_total_bytes: 80 * GiB,
      memory_used_bytes: 20 * GiB,
      memory_free_bytes: 60 * GiB,
      utilization_pct: 35.0,
      memory_utilization_pct: null,
      temperature_c: 51,
      power_w: 210.5,
      power_limit_w: 400.0,
      compute_mode: 'DEFAULT',
      mig_enabled: false,
      is_mig: false,
      parent_uuid: null,
      mig_index: null,
      processes: [
        { pid: 4242, used_memory_bytes: 20 * GiB, user: 'alice', command: null }
      ],
      available: true,
      error: null,
      timestamp_s: 1718000000.5,
      label: 'GPU 0'
    },
    {
      index: 2,
      uuid: 'GPU-2c2c',
      name: 'NVIDIA L4',
      pci_bus_id: null,
      memory_total_bytes: null,
      memory_used_bytes: null,
      memory_free_bytes: null,
      utilization_pct: null,
      temperature_c: null,
      power_w: null,
      power_limit_w: null,
      compute_mode: null,
      mig_enabled: null,
      is_mig: false,
      processes: null,
      available: false,
      error: 'GPU is lost',
      timestamp_s: 1718000000.5,
      label: 'GPU 2'
    }
  ]
};

describe('parseFleet', () => {
  it('keeps the values and the simulated flag', () => {
    const fleet = parseFleet(fleetJson);
    expect(fleet.simulated).toBe(true);
    expect(fleet.devices.map(d => d.label)).toEqual(['GPU 0', 'GPU 2']);
    expect(fleet.devices[0].memory_free_bytes).toBe(60 * GiB);
    expect(fleet.devices[0].processes).toEqual([
      { pid: 4242, used_memory_bytes: 20 * GiB, user: 'alice', command: null }
    ]);
    expect(fleet.devices[1].available).toBe(false);
    expect(fleet.devices[1].processes).toBeNull();
  });

  it('names the bad part of a malformed answer', () => {
    expect(() => parseFleet({ devices: 'none' })).toThrow(
      'unexpected devices answer from the server: {"devices":"none"}'
    );
    expect(() => parseFleet({ devices: [{ name: 'x' }] })).toThrow(
      'unexpected device from the server: {"name":"x"}'
    );
  });

  it('turns non-numbers into unknown', () => {
    const d = parseDevice({ index: 1, uuid: 'GPU-x', utilization_pct: 'N/A' });
    expect(d.utilization_pct).toBeNull();
    expect(d.label).toBe('GPU 1');
    expect(d.available).toBe(true);
  });
});

describe('formatting', () => {
  it('formats bytes in binary units', () => {
    expect(formatBytes(null)).toBe('–');
    expect(formatBytes(512)).toBe('512 B');
    expect(formatBytes(1536 * 1024 ** 2)).toBe('1.5 GiB');
    expect(formatBytes(80 * GiB)).toBe('80.0 GiB');
  });

  it('formats percentages, memory and thermals', () => {
    const [a100, lost] = parseFleet(fleetJson).devices;
    expect(formatPct(35.4)).toBe('35%');
    expect(formatPct(null)).toBe('n/a');
    expect(formatMemory(a100)).toBe('20.0 GiB / 80.0 GiB');
    expect(formatThermals(a100)).toBe('51 °C · 211 W / 400 W');
    expect(formatThermals(lost)).toBe('');
  });

  it('says which readings a device does not support', () => {
    const mig = parseDevice({
      index: 0,
      uuid: 'MIG-1',
      is_mig: true,
      memory_total_bytes: 10 * GiB,
      utilization_pct: null
    });
    expect(unsupportedNote(mig)).toBe('utilisation not supported');
    expect(unsupportedNote(parseFleet(fleetJson).devices[0])).toBeNull();
    expect(unsupportedNote(parseFleet(fleetJson).devices[1])).toBeNull();
  });
});

describe('sparklinePath', () => {
  it('maps values into the box, newest at the right edge', () => {
    expect(sparklinePath([0, 50, 100], 100, 20, 100)).toBe(
      'M0,20 L50,10 L100,0'
    );
  });

  it('clamps and breaks the line at unknown values', () => {
    expect(sparklinePath([10, null, 150, 75], 30, 10, 100)).toBe(
      'M0,9 M20,0 L30,2.5'
    );
  });

  it('right-aligns a short series in a fixed number of slots', () => {
    expect(sparklinePath([100, 0], 40, 10, 100, 5)).toBe('M30,0 L40,10');
  });

  it('keeps 0 and the maximum inside the box by the padding', () => {
    expect(sparklinePath([0, 100], 40, 24, 100, 2, 2)).toBe('M0,22 L40,2');
  });

  it('labels the top of the scale', () => {
    expect(sparkScaleTop('util', 100)).toBe('100%');
    expect(sparkScaleTop('mem', 80 * GiB)).toBe('80 GiB');
    expect(sparkScaleTop('mem', 0)).toBe('');
  });

  it('draws nothing without a scale', () => {
    expect(sparklinePath([1, 2], 40, 10, 0)).toBe('');
    expect(sparklinePath([], 40, 10, 100)).toBe('');
  });
});

describe('history', () => {
  const first: IHistory = parseHistory({
    interval_s: 1,
    history_s: 900,
    since_s: null,
    until_s: 3,
    series: [
      {
        uuid: 'GPU-0a0a',
        timestamp_s: [1, 2, 3],
        utilization_pct: [10, null, 30],
        memory_used_bytes: [1, 2, 3],
        memory_total_bytes: 80
      }
    ],
    errors: []
  });

  it('merges new samples and keeps the newest', () => {
    let kept = mergeHistory(new Map<string, ISeries>(), first, 4);
    kept = mergeHistory(
      kept,
      {
        ...first,
        since_s: 3,
        until_s: 5,
        series: [
          {
            uuid: 'GPU-0a0a',
            timestamp_s: [4, 5],
            utilization_pct: [40, 50],
            memory_used_bytes: [4, 5],
            memory_total_bytes: null
          }
        ]
      },
      4
    );
    expect(kept.get('GPU-0a0a')).toEqual({
      uuid: 'GPU-0a0a',
      timestamp_s: [2, 3, 4, 5],
      utilization_pct: [null, 30, 40, 50],
      memory_used_bytes: [2, 3, 4, 5],
      memory_total_bytes: 80
    });
  });
});

describe('holders', () => {
  const base: IHolder = {
    kind: 'lease+process',
    uuid: 'GPU-1',
    label: 'GPU 1',
    user: 'me',
    pid: 100,
    kernel_id: 'abcdef0123456789',
    this_server: true,
    notebook_path: 'work/train.ipynb',
    booked_bytes: 10 * GiB,
    used_memory_bytes: 3 * GiB,
    exclusive: false,
    created_s: 1,
    command: null,
    where: 'work/train.ipynb',
    memory_text: '10.0 GiB booked, 3.0 GiB used'
  };
  // as the server joins them (core/holders.py): the lease and its process are one holder
  const holders: IHolder[] = parseHolders({
    timestamp_s: 1,
    simulated: true,
    user: 'me',
    errors: [],
    holders: [
      {
        ...base,
        kind: 'process',
        uuid: 'GPU-1',
        user: 'alice',
        pid: 7,
        kernel_id: null,
        this_server: false,
        notebook_path: null,
        booked_bytes: null,
        used_memory_bytes: 2 * GiB,
        command: 'python train.py',
        where: 'pid 7',
        memory_text: '2.0 GiB used'
      },
      base,
      { ...base, kind: 'lease', uuid: 'GPU-9', used_memory_bytes: null }
    ]
  }).holders;

  it('lists the holders the server joined, one line each, in its order', () => {
    expect(holders.map(h => h.kind)).toEqual([
      'process',
      'lease+process',
      'lease'
    ]);
    expect(holdersFor(holders, 'GPU-1', null)).toEqual([
      {
        who: 'alice',
        what: 'pid 7',
        command: 'python train.py',
        memory: '2.0 GiB used',
        idle: '',
        current: false,
        exclusive: false
      },
      {
        who: 'me',
        what: 'work/train.ipynb',
        command: '',
        memory: '10.0 GiB booked, 3.0 GiB used',
        idle: '',
        current: false,
        exclusive: false
      }
    ]);
  });

  it("shows the server's words for a holder as they are (core/words.py)", () => {
    // the server words every holder as %gpu status and autogpu list do: no rule of its own
    // here (a command is no longer the line's words: it is its tooltip)
    const [h] = parseHolders({
      timestamp_s: 1,
      simulated: false,
      user: 'me',
      holders: [
        {
          ...base,
          notebook_path: null,
          kernel_id: null,
          command: 'python <b>x</b>.py',
          exclusive: true,
          where: 'pid 100',
          memory_text: '10.0 GiB booked, exclusive'
        }
      ]
    }).holders;
    expect(holdersFor([h], 'GPU-1', null)).toEqual([
      {
        who: 'me',
        what: 'pid 100',
        command: 'python <b>x</b>.py',
        memory: '10.0 GiB booked, exclusive',
        idle: '',
        current: false,
        exclusive: true
      }
    ]);
  });

  it('says "nobody" for a device nobody holds, as every other view does', () => {
    expect(nobodyText()).toBe('nobody');
    const seen: string[] = [];
    const trans: ITrans = {
      __: (msg: string) => {
        seen.push(msg);
        return 'personne';
      },
      _n: (msg: string) => msg
    };
    expect(nobodyText(trans)).toBe('personne');
    expect(seen).toEqual(['nobody']);
  });

  it('says how long a kernel holding the GPU has been idle', () => {
    const kernels = [
      {
        kernel_id: 'abcdef0123456789',
        notebook_path: 'work/train.ipynb',
        execution_state: 'idle',
        idle_s: 43 * 60 + 5,
        movable: false,
        picked_uuids: [],
        constraints_text: null,
        note: null,
        overload: null,
        better: null,
        waiting: false,
        allowed_uuids: null,
        best_move: null,
        cull_warning: null
      }
    ];
    const views = holdersFor(holders, 'GPU-1', null, kernels);
    expect(views.map(v => [v.what, v.idle])).toEqual([
      ['pid 7', ''],
      ['work/train.ipynb', 'idle 43 min']
    ]);
    expect(formatIdle(null)).toBe('');
    expect(formatIdle(59)).toBe('');
    expect(formatIdle(60)).toBe('idle 1 min');
    expect(formatIdle(2 * 3600 + 5 * 60)).toBe('idle 2 h 5 min');
    expect(formatIdle(3 * 3600)).toBe('idle 3 h');
  });

  it('totals per user: devices, booked and used memory, largest first', () => {
    const totals = userTotals(holders);
    expect(totals).toEqual([
      { user: 'me', devices: 2, booked_bytes: 20 * GiB, used_bytes: 3 * GiB },
      { user: 'alice', devices: 1, booked_bytes: 0, used_bytes: 2 * GiB }
    ]);
    expect(totals.map(t => formatUserTotal(t))).toEqual([
      'me: 2 GPUs, 20.0 GiB booked, 3.0 GiB used',
      'alice: 1 GPU, 2.0 GiB used'
    ]);
  });

  it("knows my GPUs: the server user's and the active kernel's", () => {
    const all = parseHolders({ user: 'me', holders, kernels: [], errors: [] });
    expect([...myDevices(all, null)].sort()).toEqual(['GPU-1', 'GPU-9']);
    const other = parseHolders({
      user: 'bob',
      holders,
      kernels: [],
      errors: []
    });
    expect([...myDevices(other, null)]).toEqual([]);
    expect([...myDevices(other, 'abcdef0123456789')].sort()).toEqual([
      'GPU-1',
      'GPU-9'
    ]);
    expect([...myDevices(null, 'abcdef0123456789')]).toEqual([]);
  });

  it('puts the active notebook kernel first, highlighted', () => {
    const views = holdersFor(holders, 'GPU-1', 'abcdef0123456789');
    expect(views.map(v => [v.what, v.current])).toEqual([
      ['work/train.ipynb', true],
      ['pid 7', false]
    ]);
  });

  // a kernel without a notebook is worded "kernel abcdef01" by the server (core/words.py;
  // tests/unit/test_holders.py and test_payloads.py::test_holders_whole pin it)
});

describe('recommendationText', () => {
  it('says which device is best for the request', () => {
    const sel = parseSelection({
      chosen: [{ uuid: 'GPU-3', label: 'GPU 3', name: 'NVIDIA L4' }],
      constraints_text: 'min free 10.0 GiB',
      message: null,
      simulated: false
    });
    // a no-break space: the label never wraps as "GPU" / "3"
    expect(recommendationText(sel)).toBe(
      'best device for 10.0 GiB: GPU\u00a03'
    );
  });

  it('says best device now without constraints', () => {
    const sel = parseSelection({
      chosen: [{ uuid: 'GPU-0', label: 'GPU 0', name: 'A100' }],
      constraints_text: 'no constraints',
      message: null
    });
    expect(recommendationText(sel)).toBe('best device now: GPU\u00a00');
  });

  it('says so when the notebook already sits on the best device', () => {
    const sel = parseSelection({
      chosen: [{ uuid: 'GPU-2', label: 'GPU 2', name: 'A100' }],
      constraints_text: 'min free 10.0 GiB',
      message: null
    });
    expect(recommendationText(sel, ['GPU-2'])).toBe(
      'you are already on the best device for 10.0 GiB: GPU\u00a02'
    );
    expect(recommendationText(sel, ['GPU-1'])).toBe(
      'best device for 10.0 GiB: GPU\u00a02'
    );
  });

  it('finds the devices of the notebook kernel in its leases and processes', () => {
    const holder = {
      kind: 'lease',
      uuid: 'GPU-2',
      label: 'GPU 2',
      user: 'me',
      pid: 5,
      kernel_id: 'k1',
      this_server: true,
      notebook_path: 'a.ipynb',
      booked_bytes: 1,
      used_memory_bytes: null,
      exclusive: false,
      created_s: 1,
      command: null,
      where: 'a.ipynb',
      memory_text: '1 B booked'
    };
    const holders = parseHolders({
      timestamp_s: 1,
      simulated: false,
      user: 'me',
      holders: [
        holder,
        { ...holder, kind: 'process', uuid: 'GPU-3', kernel_id: null }
      ],
      kernels: [],
      errors: []
    });
    expect(notebookDevices(holders, 'k1')).toEqual(['GPU-2']);
    expect(notebookDevices(holders, 'k9')).toEqual([]);
    expect(notebookDevices(null, 'k1')).toEqual([]);
  });

  it('passes the server reason when nothing fits', () => {
    const sel = parseSelection({
      chosen: [],
      constraints_text: 'min free 70.0 GiB',
      message: 'no device fits (min free 70.0 GiB):'
    });
    expect(recommendationText(sel)).toBe('no device fits (min free 70.0 GiB):');
  });
});

describe('overloadToNotify', () => {
  const kernel = {
    kernel_id: 'k1',
    notebook_path: 'a.ipynb',
    execution_state: 'idle',
    idle_s: null,
    movable: false,
    picked_uuids: [],
    constraints_text: null,
    note: null,
    overload: null as string | null,
    better: null,
    waiting: false,
    allowed_uuids: null,
    best_move: null,
    cull_warning: null
  };
  const warning = (pct: number) =>
    `autogpu: GPU 1 (this kernel's GPU) is overloaded: memory ${pct}% full (over 95%), ` +
    'caused by 1 other process. Best alternative: move to GPU 2.';

  it('announces an overload once, and again after it cleared', () => {
    const shown = new Map<string, string>();
    expect(overloadToNotify(null, shown)).toBeNull();
    expect(overloadToNotify(kernel, shown)).toBeNull();
    expect(overloadToNotify({ ...kernel, overload: warning(97) }, shown)).toBe(
      warning(97)
    );
    // the numbers move, the overload is the same: no second notification
    expect(
      overloadToNotify({ ...kernel, overload: warning(98) }, shown)
    ).toBeNull();
    expect(overloadToNotify(kernel, shown)).toBeNull();
    expect(overloadToNotify({ ...kernel, overload: warning(99) }, shown)).toBe(
      warning(99)
    );
  });
});

describe('waitsEnded', () => {
  const answer = (waiting: boolean, leased: boolean) =>
    parseHolders({
      user: 'me',
      errors: [],
      holders: leased
        ? [
            {
              kind: 'lease',
              uuid: 'GPU-2',
              label: 'GPU 2',
              user: 'me',
              kernel_id: 'k1',
              this_server: true
            }
          ]
        : [],
      kernels: [
        {
          kernel_id: 'k1',
          notebook_path: 'train.ipynb',
          waiting,
          movable: false
        }
      ]
    });

  it('says once when a kernel that waited in line got its GPU', () => {
    const waiting = new Set<string>();
    expect(waitsEnded(answer(false, false), waiting)).toEqual([]);
    expect(waitsEnded(answer(true, false), waiting)).toEqual([]);
    expect([...waiting]).toEqual(['k1']);
    expect(waitsEnded(answer(false, true), waiting)).toEqual([
      'train.ipynb got its GPU: GPU 2 (it waited in line)'
    ]);
    expect(waitsEnded(answer(false, true), waiting)).toEqual([]);
  });

  it('says nothing when the wait ended without a GPU (cancelled)', () => {
    const waiting = new Set<string>(['k1']);
    expect(waitsEnded(answer(false, false), waiting)).toEqual([]);
    expect(waiting.size).toBe(0);
  });
});

describe('pickCodeFor', () => {
  const fleet = parseFleet(fleetJson);
  const [gpu0, lost] = fleet.devices;
  const plain = {
    kernel_id: 'k1',
    notebook_path: 'a.ipynb',
    execution_state: 'idle',
    idle_s: null,
    movable: false,
    picked_uuids: [],
    constraints_text: null,
    note: null,
    overload: null,
    better: null,
    waiting: false,
    allowed_uuids: null,
    best_move: null,
    cull_warning: null
  };
  const none = parseHolders({
    user: 'me',
    holders: [],
    kernels: [],
    errors: []
  });

  it("picks in the notebook's own kernel, that one device, by its UUID", () => {
    expect(pickCodeFor(gpu0, plain, none, 'k1')).toBe(
      '__import__("autogpu_jupyter.magics", fromlist=["sidebar_pick"])' +
        '.sidebar_pick("GPU-0a0a")'
    );
    // no %load_ext (IPython would print "already loaded"), no --exclude, no --wait
    expect(pickCodeFor(gpu0, plain, none, 'k1')).not.toMatch(
      /load_ext|exclude|wait/
    );
    // a UUID is one Python string literal, whatever it holds
    const odd = { ...gpu0, uuid: 'GPU-"); import os; ("' };
    expect(pickCodeFor(odd, plain, none, 'k1')).toContain(
      'sidebar_pick("GPU-\\"); import os; (\\"")'
    );
  });

  it('offers nothing where a pick makes no sense', () => {
    // a lost card, no notebook, an autogpu kernel (it picks before starting)
    expect(pickCodeFor(lost, plain, none, 'k1')).toBeNull();
    expect(pickCodeFor(gpu0, plain, none, null)).toBeNull();
    expect(
      pickCodeFor(gpu0, { ...plain, movable: true }, none, 'k1')
    ).toBeNull();
    // the kernel already holds a GPU
    const held = parseHolders({
      user: 'me',
      holders: [{ kind: 'lease', uuid: 'GPU-0a0a', kernel_id: 'k1' }],
      kernels: [],
      errors: []
    });
    expect(pickCodeFor(gpu0, plain, held, 'k1')).toBeNull();
  });

  it("offers only the devices inside the kernel's allocation", () => {
    const narrowed = { ...plain, allowed_uuids: ['GPU-9'] };
    expect(pickCodeFor(gpu0, narrowed, none, 'k1')).toBeNull();
    expect(
      pickCodeFor(gpu0, { ...plain, allowed_uuids: ['GPU-0a0a'] }, none, 'k1')
    ).not.toBeNull();
    // the server could not read the allocation: every device, as before
    expect(pickCodeFor(gpu0, plain, none, 'k1')).not.toBeNull();
    const parsed = parseHolders({
      user: 'me',
      holders: [],
      kernels: [{ kernel_id: 'k1', allowed_uuids: ['GPU-9', 3] }],
      errors: []
    });
    expect(parsed.kernels[0].allowed_uuids).toEqual(['GPU-9']);
  });

  it("reads the kernel's one-line answer and its details", () => {
    expect(
      parsePickOutcome({
        ok: false,
        summary: 'autogpu: GPU 1 cannot be picked'
      })
    ).toEqual({
      ok: false,
      summary: 'autogpu: GPU 1 cannot be picked',
      details: ''
    });
    expect(() => parsePickOutcome({ ok: true })).toThrow(/pick answer/);
  });
});

describe('one better GPU', () => {
  const kernel = parseHolders({
    user: 'me',
    holders: [],
    errors: [],
    kernels: [
      {
        kernel_id: 'k1',
        overload:
          "GPU 1 (this kernel's GPU) is overloaded: memory 97% full, 1 other process. " +
          'Better now: GPU 2.',
        better: { uuid: 'GPU-2', label: 'GPU 2' }
      },
      { kernel_id: 'k2', overload: null, better: null }
    ]
  }).kernels;

  it("says on top what the notification says, and badges that device's card", () => {
    expect(overloadAdvice(kernel[0])).toEqual({
      text:
        "GPU 1 (this kernel's GPU) is overloaded: memory 97% full, 1 other process. " +
        'Better now: GPU 2.',
      uuid: 'GPU-2'
    });
    expect(overloadAdvice(kernel[1])).toBeNull();
    expect(overloadAdvice(null)).toBeNull();
  });

  it('says each error once', () => {
    expect(uniqueErrors(['no driver', ' no driver', 'registry', ''])).toEqual([
      'no driver',
      'registry'
    ]);
  });
});

describe('translation', () => {
  // a bundle that marks every word it translated
  const marked: ITrans = {
    __: (msgid: string, ...args: unknown[]) =>
      '«' + noTranslation.__(msgid, ...args) + '»',
    _n: (one: string, many: string, n: number, ...args: unknown[]) =>
      '«' + noTranslation._n(one, many, n, ...args) + '»'
  };

  it('puts every word the sidebar writes through the bundle', () => {
    expect(
      formatUserTotal(
        { user: 'ann', devices: 2, booked_bytes: GiB, used_bytes: 0 },
        marked
      )
    ).toBe('ann: «2 GPUs», «1.0 GiB booked»');
    expect(formatIdle(3700, marked)).toBe('«idle 1 h 1 min»');
    expect(formatPct(null, marked)).toBe('«n/a»');
    const sel = parseSelection({
      chosen: [{ uuid: 'GPU-3', label: 'GPU 3' }],
      constraints_text: 'min free 10.0 GiB'
    });
    expect(recommendationText(sel, [], marked)).toBe(
      '«best device for 10.0 GiB: GPU\u00a03»'
    );
  });

  it('fills numbered placeholders as JupyterLab does', () => {
    expect(noTranslation.__('%2 before %1', 'a', 'b')).toBe('b before a');
    expect(noTranslation._n('%1 GPU', '%1 GPUs', 1, 1)).toBe('1 GPU');
    expect(noTranslation.__('100%')).toBe('100%');
  });
});
