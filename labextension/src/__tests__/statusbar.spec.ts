import {
  IFleet,
  ITrans,
  cullWarningToNotify,
  gpuStatus,
  kernelInfoFor,
  noTranslation,
  parseFleet,
  parseHolders
} from '../model';

const GiB = 1024 ** 3;

function gpu(index: number, extra: Record<string, unknown> = {}) {
  return {
    index,
    uuid: `GPU-${index}`,
    name: 'NVIDIA A100',
    label: `GPU ${index}`,
    memory_total_bytes: 80 * GiB,
    memory_used_bytes: 20 * GiB,
    utilization_pct: 35,
    available: true,
    ...extra
  };
}

const fleet: IFleet = parseFleet({
  timestamp_s: 1,
  backend: 'nvml',
  simulated: false,
  errors: [],
  interval_s: 1,
  devices: [
    gpu(0),
    gpu(1, { utilization_pct: 98.4, memory_used_bytes: 78 * GiB })
  ]
});

function holdersWith(kernel: Record<string, unknown>, holders: unknown[] = []) {
  return parseHolders({
    timestamp_s: 1,
    simulated: false,
    user: 'me',
    errors: [],
    holders,
    kernels: [{ kernel_id: 'k-1', notebook_path: 'train.ipynb', ...kernel }]
  });
}

describe('gpuStatus: the status-bar item of the active notebook', () => {
  it('names the GPU the kernel holds, its utilisation and memory', () => {
    const holders = holdersWith({}, [
      { kind: 'lease', uuid: 'GPU-1', kernel_id: 'k-1', this_server: true }
    ]);
    expect(gpuStatus(holders, fleet, 'k-1')).toEqual({
      text: 'GPU 1 · 98% · 78.0 GiB / 80.0 GiB',
      title: "This notebook's GPU: GPU 1. Click to open the GPU sidebar.",
      overloaded: false
    });
  });

  it('marks an overloaded GPU and says why in the tooltip', () => {
    const overload =
      "GPU 1 (this kernel's GPU) is overloaded: memory 98% full, 1 other process.";
    const holders = holdersWith({
      movable: true,
      picked_uuids: ['GPU-1'],
      overload
    });
    expect(gpuStatus(holders, fleet, 'k-1')).toMatchObject({
      title: overload,
      overloaded: true
    });
  });

  it('shows every GPU of a kernel on two', () => {
    const holders = holdersWith({
      movable: true,
      picked_uuids: ['GPU-0', 'GPU-1']
    });
    expect(gpuStatus(holders, fleet, 'k-1')?.text).toBe(
      'GPU 0 · 35% · 20.0 GiB / 80.0 GiB | GPU 1 · 98% · 78.0 GiB / 80.0 GiB'
    );
  });

  it('says a lost GPU is lost', () => {
    const lost = parseFleet({
      ...fleet,
      devices: [gpu(0, { available: false, error: 'GPU is lost' })]
    });
    const holders = holdersWith({ movable: true, picked_uuids: ['GPU-0'] });
    expect(gpuStatus(holders, lost, 'k-1')?.text).toBe('GPU 0 · lost');
  });

  it('shows nothing for a kernel without a GPU, or before the answers', () => {
    const holders = holdersWith({});
    expect(gpuStatus(holders, fleet, 'k-1')).toBeNull();
    expect(gpuStatus(holders, fleet, null)).toBeNull();
    expect(gpuStatus(null, fleet, 'k-1')).toBeNull();
    expect(gpuStatus(holders, null, 'k-1')).toBeNull();
  });

  it('translates its words', () => {
    const upper: ITrans = {
      __: (msgid: string, ...args: unknown[]) =>
        noTranslation.__(msgid.toUpperCase(), ...args),
      _n: noTranslation._n
    };
    const holders = holdersWith({ movable: true, picked_uuids: ['GPU-0'] });
    expect(gpuStatus(holders, fleet, 'k-1', upper)?.title).toBe(
      "THIS NOTEBOOK'S GPU: GPU 0. CLICK TO OPEN THE GPU SIDEBAR."
    );
  });
});

describe('cullWarningToNotify', () => {
  const warning =
    'GPU 1 will be freed in 5 min: this kernel (train.ipynb) has been idle 25 min.';

  it('notifies once per idle stretch, again after the kernel was active', () => {
    const shown = new Set<string>();
    const warned = kernelInfoFor(holdersWith({ cull_warning: warning }), 'k-1');
    const active = kernelInfoFor(holdersWith({}), 'k-1');
    expect(cullWarningToNotify(warned, shown)).toBe(warning);
    expect(cullWarningToNotify(warned, shown)).toBeNull();
    expect(cullWarningToNotify(active, shown)).toBeNull();
    expect(cullWarningToNotify(warned, shown)).toBe(warning);
    expect(cullWarningToNotify(null, shown)).toBeNull();
  });

  it('puts the warning in the status item tooltip', () => {
    const holders = holdersWith({
      picked_uuids: ['GPU-1'],
      movable: true,
      cull_warning: warning
    });
    expect(gpuStatus(holders, fleet, 'k-1')?.title).toBe(warning);
  });
});
