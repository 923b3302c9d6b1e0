/**
 * The parsers of the server's answers, field by field: what a malformed answer is refused with
 * (one message naming the part), which defaults a missing or mistyped field takes, and that a
 * present field comes through as sent (issue 22: the survivors of `make mutate-ts`).
 */
import { parseCluster, parseClusterHistory } from '../clustermodel';
import {
  formatBytes,
  noTranslation,
  parseDevice,
  parseFleet,
  parseHistory,
  parseHolders,
  parseMoveResult,
  parsePickOutcome,
  parseSelection,
  PICK_MIME
} from '../model';

// Not an object, an array, null: refused like an object without the required field.
const NOT_OBJECTS: unknown[] = [null, [], 'x', 3, undefined];

describe('malformed answers are refused with the part named', () => {
  const cases: [string, (raw: unknown) => unknown, object, RegExp][] = [
    ['devices', parseFleet, { devices: [] }, /unexpected devices answer/],
    ['history', parseHistory, { series: [] }, /unexpected history answer/],
    ['holders', parseHolders, { holders: [] }, /unexpected holders answer/],
    ['select', parseSelection, { chosen: [] }, /unexpected select answer/],
    ['move', parseMoveResult, { message: 'm' }, /unexpected move answer/],
    ['pick', parsePickOutcome, { summary: 's' }, /unexpected pick answer/],
    [
      'cluster',
      parseCluster,
      { configured: true },
      /unexpected cluster answer/
    ],
    [
      'cluster history',
      parseClusterHistory,
      { hosts: [] },
      /unexpected cluster history/
    ]
  ];
  for (const [name, parse, good, message] of cases) {
    it(`${name}: the smallest good answer parses, anything else is refused`, () => {
      expect(() => parse(good)).not.toThrow();
      for (const bad of NOT_OBJECTS) {
        expect(() => parse(bad)).toThrow(message);
      }
      for (const key of Object.keys(good)) {
        // the required field missing, or of another type
        const missing = { ...good } as Record<string, unknown>;
        delete missing[key];
        expect(() => parse(missing)).toThrow(message);
        expect(() => parse({ ...good, [key]: 7 })).toThrow(message);
      }
    });
  }

  it('names the bad part inside an answer', () => {
    const dev = { uuid: 'GPU-a', index: 0 };
    expect(() => parseDevice({ index: 0 })).toThrow(/unexpected device/);
    expect(() => parseDevice({ uuid: 'GPU-a' })).toThrow(/unexpected device/);
    expect(() => parseDevice([])).toThrow(/unexpected device/);
    expect(() => parseDevice({ ...dev, processes: [{ pid: '1' }] })).toThrow(
      /unexpected process/
    );
    expect(() => parseDevice({ ...dev, processes: [[]] })).toThrow(
      /unexpected process/
    );
    expect(() =>
      parseHistory({ series: [{ uuid: 'GPU-a', timestamp_s: 3 }] })
    ).toThrow(/unexpected history series/);
    expect(() => parseHistory({ series: [{ timestamp_s: [] }] })).toThrow(
      /unexpected history series/
    );
    expect(() => parseHistory({ series: [[]] })).toThrow(
      /unexpected history series/
    );
    expect(() => parseHolders({ holders: [{ uuid: 3 }] })).toThrow(
      /unexpected holder/
    );
    expect(() => parseHolders({ holders: [[]] })).toThrow(/unexpected holder/);
    expect(() => parseSelection({ chosen: [{ label: 'x' }] })).toThrow(
      /unexpected chosen device/
    );
    expect(() => parseSelection({ chosen: [[]] })).toThrow(
      /unexpected chosen device/
    );
    const cluster = { configured: true };
    expect(() =>
      parseCluster({ ...cluster, hosts: [{ state: 'ok' }] })
    ).toThrow(/unexpected cluster host/);
    expect(() =>
      parseCluster({ ...cluster, hosts: [{ hostname: 'a', devices: [{}] }] })
    ).toThrow(/unexpected cluster device/);
    expect(() =>
      parseCluster({ ...cluster, hosts: [{ hostname: 'a', devices: [[]] }] })
    ).toThrow(/unexpected cluster device/);
    expect(() =>
      parseCluster({ ...cluster, ranking: [{ fits: true }] })
    ).toThrow(/unexpected cluster ranking/);
    expect(() => parseCluster({ ...cluster, ranking: [[]] })).toThrow(
      /unexpected cluster ranking/
    );
    expect(() => parseClusterHistory({ hosts: [{}] })).toThrow(
      /unexpected cluster history host/
    );
  });
});

describe('defaults and present fields', () => {
  it('a device: the defaults of a bare record, and every field as sent', () => {
    expect(parseDevice({ uuid: 'GPU-a', index: 2 })).toEqual({
      index: 2,
      uuid: 'GPU-a',
      name: 'GPU',
      label: 'GPU 2',
      pci_bus_id: null,
      memory_total_bytes: null,
      memory_used_bytes: null,
      memory_free_bytes: null,
      utilization_pct: null,
      memory_utilization_pct: null,
      temperature_c: null,
      power_w: null,
      power_limit_w: null,
      compute_mode: null,
      is_mig: false,
      mig_enabled: null,
      parent_uuid: null,
      mig_index: null,
      processes: null,
      available: true,
      error: null,
      vendor: 'nvidia',
      runtime_uuid: null,
      timestamp_s: 0
    });
    const d = parseDevice({
      uuid: 'GPU-a',
      index: 0,
      name: 'A100',
      label: 'MIG 0/1',
      is_mig: true,
      mig_enabled: false,
      timestamp_s: 12,
      utilization_pct: Infinity,
      temperature_c: '40',
      processes: [{ pid: 4, used_memory_bytes: NaN, user: 5, command: 'x' }]
    });
    expect(d.name).toBe('A100');
    expect(d.label).toBe('MIG 0/1');
    expect(d.is_mig).toBe(true);
    expect(d.mig_enabled).toBe(false);
    expect(d.timestamp_s).toBe(12);
    expect(d.utilization_pct).toBeNull(); // not finite
    expect(d.temperature_c).toBeNull(); // not a number
    expect(d.processes).toEqual([
      { pid: 4, used_memory_bytes: null, user: null, command: 'x' }
    ]);
    // mistyped optional fields take their defaults
    const m = parseDevice({
      uuid: 'GPU-a',
      index: 1,
      name: 3,
      label: 3,
      is_mig: 'yes',
      mig_enabled: 'no'
    });
    expect([m.name, m.label, m.is_mig, m.mig_enabled]).toEqual([
      'GPU',
      'GPU 1',
      false,
      null
    ]);
    expect(
      parseDevice({ uuid: 'u', index: 0, mig_enabled: true }).mig_enabled
    ).toBe(true);
  });

  it('a fleet: the defaults, and the fields as sent', () => {
    expect(parseFleet({ devices: [] })).toEqual({
      timestamp_s: 0,
      backend: null,
      simulated: false,
      driver_version: null,
      errors: [],
      devices: [],
      interval_s: 1
    });
    const f = parseFleet({
      devices: [],
      timestamp_s: 5,
      simulated: 'true',
      interval_s: 2,
      errors: ['a', 3, 'b']
    });
    expect([f.timestamp_s, f.simulated, f.interval_s]).toEqual([5, false, 2]);
    expect(f.errors).toEqual(['a', 'b']);
    expect(parseFleet({ devices: [], simulated: true }).simulated).toBe(true);
  });

  it('a history: the defaults, and the fields as sent', () => {
    expect(parseHistory({ series: [] })).toEqual({
      interval_s: 1,
      history_s: 0,
      since_s: null,
      until_s: null,
      series: [],
      errors: []
    });
    const h = parseHistory({
      interval_s: 3,
      history_s: 600,
      series: [{ uuid: 'u', timestamp_s: [1, 'x'], utilization_pct: 5 }]
    });
    expect([h.interval_s, h.history_s]).toEqual([3, 600]);
    expect(h.series[0]).toEqual({
      uuid: 'u',
      timestamp_s: [1, 0],
      utilization_pct: [],
      memory_used_bytes: [],
      memory_total_bytes: null
    });
  });

  it('holders: kinds, flags and the kernels', () => {
    const h = parseHolders({
      timestamp_s: 9,
      simulated: true,
      user: 'ann',
      holders: [
        { uuid: 'a', kind: 'lease', exclusive: true },
        { uuid: 'b', kind: 'lease+process' },
        { uuid: 'c', kind: 'other', exclusive: 'yes' }
      ],
      kernels: [
        { kernel_id: 'k1', better: { uuid: 'u', label: 3 } },
        { kernel_id: 'k2', better: { uuid: 3, label: 'l' } },
        { kernel_id: 'k3', better: { uuid: 'u', label: 'GPU 1' } }
      ]
    });
    expect(h.holders.map(x => x.kind)).toEqual([
      'lease',
      'lease+process',
      'process'
    ]);
    expect(h.holders.map(x => x.exclusive)).toEqual([true, false, false]);
    expect([h.timestamp_s, h.simulated, h.user]).toEqual([9, true, 'ann']);
    expect(h.kernels.map(k => k.better)).toEqual([
      null,
      null,
      { uuid: 'u', label: 'GPU 1' }
    ]);
    const bare = parseHolders({ holders: [], simulated: 1, user: 5 });
    expect([bare.timestamp_s, bare.simulated, bare.user]).toEqual([
      0,
      false,
      ''
    ]);
    expect(bare.kernels).toEqual([]);
  });

  it('a selection: label and name default, flags as sent', () => {
    const s = parseSelection({
      chosen: [{ uuid: 'u' }, { uuid: 'v', label: 'GPU 1', name: 'A100' }],
      constraints_text: 'min free 1 GiB',
      simulated: true
    });
    expect(s.chosen).toEqual([
      { uuid: 'u', label: 'u', name: '' },
      { uuid: 'v', label: 'GPU 1', name: 'A100' }
    ]);
    expect([s.constraints_text, s.simulated]).toEqual(['min free 1 GiB', true]);
    const bare = parseSelection({
      chosen: [{ uuid: 'u', name: 3 }],
      simulated: 'y',
      constraints_text: 3
    });
    expect([
      bare.constraints_text,
      bare.simulated,
      bare.chosen[0].name
    ]).toEqual(['', false, '']);
  });

  it('a move: the plan is the message unless sent', () => {
    const m = parseMoveResult({ message: 'moved', dry_run: 'yes' });
    expect([m.plan, m.dry_run]).toEqual(['moved', false]);
    const p = parseMoveResult({
      message: 'm',
      plan: 'the plan',
      dry_run: true
    });
    expect([p.plan, p.dry_run]).toEqual(['the plan', true]);
  });

  it('a pick outcome: ok only when true, details only when a string', () => {
    expect(parsePickOutcome({ summary: 's', ok: true, details: 'd' })).toEqual({
      ok: true,
      summary: 's',
      details: 'd'
    });
    expect(parsePickOutcome({ summary: 's', ok: 1, details: 2 })).toEqual({
      ok: false,
      summary: 's',
      details: ''
    });
    expect(PICK_MIME).toBe('application/vnd.autogpu.pick+json');
  });

  it('a cluster: the defaults, and the fields as sent', () => {
    const bare = parseCluster({
      configured: false,
      hosts: [{ hostname: 'a', devices: [{ uuid: 'u' }] }],
      ranking: [
        { hostname: 'a', fits: 'yes', chosen: [{ label: 'GPU 0' }, 3, {}] }
      ]
    });
    expect(bare.timestamp_s).toBe(0);
    expect(bare.constraints_text).toBe('');
    expect(bare.hosts[0].state).toBe('ok');
    expect(bare.hosts[0].devices[0]).toEqual({
      uuid: 'u',
      label: 'u',
      name: '',
      available: true,
      source: 'autogpu',
      utilization_pct: null,
      memory_used_bytes: null,
      memory_total_bytes: null,
      memory_booked_bytes: 0,
      lease_count: 0,
      holders: []
    });
    expect(bare.ranking).toEqual([
      { hostname: 'a', fits: false, chosen: ['GPU 0'] }
    ]);
    const c = parseCluster({
      configured: true,
      timestamp_s: 7,
      constraints_text: 'min free 2 GiB',
      hosts: [
        {
          hostname: 'b',
          devices: [
            {
              uuid: 'u',
              lease_count: 2,
              utilization_pct: NaN,
              name: 'H100',
              holders: ['x', 1]
            }
          ]
        }
      ],
      ranking: [{ hostname: 'b', fits: true, chosen: [] }]
    });
    expect([c.timestamp_s, c.constraints_text]).toEqual([7, 'min free 2 GiB']);
    expect(c.hosts[0].devices[0].lease_count).toBe(2);
    expect(c.hosts[0].devices[0].utilization_pct).toBeNull();
    expect(c.hosts[0].devices[0].name).toBe('H100');
    expect(c.hosts[0].devices[0].holders).toEqual(['x']);
    expect(c.ranking[0].fits).toBe(true);
  });

  it('a cluster history: the seconds default, and the lists as sent', () => {
    const h = parseClusterHistory({
      hosts: [{ hostname: 'a', utilization_pct: [1, 'x'], memory_used_pct: 3 }]
    });
    expect(h.seconds).toBe(0);
    expect(h.hosts.get('a')).toEqual({
      hostname: 'a',
      utilization_pct: [1, null],
      memory_used_pct: []
    });
  });
});

describe('texts', () => {
  it('fills %1..%n and leaves other placeholders as written', () => {
    expect(noTranslation.__('%1 and %2, %0 %3 %10', 'a', 'b')).toBe(
      'a and b, %0 %3 %10'
    );
    const ten = Array.from({ length: 10 }, (_, i) => `v${i + 1}`);
    expect(noTranslation.__('%10', ...ten)).toBe('v10');
  });

  it('formats bytes in binary units, up to TiB', () => {
    expect(formatBytes(null)).toBe('–');
    expect(formatBytes(NaN)).toBe('–');
    expect(formatBytes(Infinity)).toBe('–');
    expect(formatBytes(1023)).toBe('1023 B');
    expect(formatBytes(1024)).toBe('1.0 KiB');
    expect(formatBytes(1536 * 1024)).toBe('1.5 MiB');
    expect(formatBytes(2 * 1024 ** 3)).toBe('2.0 GiB');
    expect(formatBytes(3 * 1024 ** 4)).toBe('3.0 TiB');
    expect(formatBytes(2048 * 1024 ** 4)).toBe('2048.0 TiB');
    expect(formatBytes(-2048)).toBe('-2.0 KiB');
  });
});
